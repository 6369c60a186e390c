"""Tests for s24jax/data/hf_tokenizer.py: the GPT-2 BPE written as Hugging Face files, and the
check that a directory's tokenizer is the run's. References: tiktoken's GPT-2 ids (the run's
tokenizer, s24jax/data/tokenizer.py) against the ids `transformers.AutoTokenizer` and the
`tokenizers` library read from the written files."""

from __future__ import annotations

import json

import pytest

from s24jax.data import hf_tokenizer
from s24jax.data import tokenizer

transformers = pytest.importorskip('transformers', reason='needs transformers (test extras)')
tokenizers = pytest.importorskip('tokenizers', reason='needs tokenizers (with transformers)')

TEXTS = ['Hello world, naïve café!', '  two spaces\n\n\tand a tab   ', "it's we'll I'd",
         'numbers 12345 67.89e-3 and 1,000', 'emoji 😀👍🏽, 漢字, ру́сский', 'a\r\nb', ' ', '',
         'Roof shingle removal: A man is sitting on a roof. He', 'x' * 500]


@pytest.fixture(scope='module')
def written(tmp_path_factory):
  out = tmp_path_factory.mktemp('tok')
  hf_tokenizer.write_gpt2(out, seq_len=1024)
  return out


def test_written_files_give_tiktoken_ids(written):
  enc = tokenizer.get_tokenizer()
  auto = transformers.AutoTokenizer.from_pretrained(str(written))
  raw = tokenizers.Tokenizer.from_file(str(written / 'tokenizer.json'))
  for text in TEXTS:
    ids = enc.encode_ordinary(text)
    assert auto(text)['input_ids'] == ids, text
    assert raw.encode(text).ids == ids, text
    assert auto.decode(ids) == text
  assert auto.eos_token_id == auto.bos_token_id == tokenizer.EOT_ID
  assert auto.convert_tokens_to_ids(tokenizer.EOT_TOKEN) == tokenizer.EOT_ID
  assert len(auto) == tokenizer.VOCAB_SIZE


def test_vocab_and_merges_alone_give_the_same_ids(written, tmp_path):
  """Older readers use vocab.json and merges.txt (from_pretrained, not the vocab_file=
  constructor that transformers 5 breaks)."""
  for name in ('vocab.json', 'merges.txt', 'tokenizer_config.json'):
    (tmp_path / name).write_bytes((written / name).read_bytes())
  auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  enc = tokenizer.get_tokenizer()
  for text in TEXTS:
    assert auto(text)['input_ids'] == enc.encode_ordinary(text), text


def test_check_accepts_gpt2_and_refuses_the_rest(written, tmp_path):
  hf_tokenizer.check(written, 'gpt2')
  tok = json.loads((written / 'tokenizer.json').read_text())
  tok['model']['merges'] = tok['model']['merges'][:-1]
  (tmp_path / 'tokenizer.json').write_text(json.dumps(tok))
  with pytest.raises(hf_tokenizer.TokenizerFilesError, match="0 of 50257 .* merges differ"):
    hf_tokenizer.check(tmp_path, 'gpt2')
  (tmp_path / 'tokenizer.json').unlink()
  with pytest.raises(hf_tokenizer.TokenizerFilesError, match='no tokenizer files'):
    hf_tokenizer.check(tmp_path, 'gpt2')
  with pytest.raises(hf_tokenizer.TokenizerFilesError, match='UTF-8 bytes'):
    hf_tokenizer.check(written, 'bytes')
  (tmp_path / hf_tokenizer.MARKER).write_text(json.dumps({'tokenizer': 'utf8-bytes-257'}))
  hf_tokenizer.check(tmp_path, 'bytes')
