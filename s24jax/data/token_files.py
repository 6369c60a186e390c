"""Token files as the GPT-2 speed-run community writes them, used as they are (memory-mapped).

Two layouts of flat uint16 token ids:
  - nanoGPT (`data/*/prepare.py`): the raw ids, `np.array(ids, np.uint16).tofile(path)`;
  - llm.c (`dev/data/data_common.py`, `write_datafile`): a header of 256 int32 (header[0] =
    the magic 20240520, header[1] = the version, 1 for uint16 GPT-2 ids, header[2] = the
    token count), then the ids. Version 2 (uint32 LLaMA-3 ids) is refused: s24jax's
    tokenizers are GPT-2's BPE and bytes.
A file is told apart by its first int32: the magic is 0x0134D7C8, whose low uint16 (55240)
is no GPT-2 id (< 50257) nor byte id (< 257), so a raw file cannot start like a header.

A folder of `.bin` files (data.path, data.name='token_files' or detected) is split by name:
files whose name says val / valid / validation (llm.c's `fineweb_val_000000.bin`, nanoGPT's
`val.bin`) are the validation stream, the others the training stream, each in name order;
several files make one stream without a copy (`ShardedTokens`). With no validation file, the
last `data.val_fraction` of the training stream is held out (a view, no copy). Every file is
checked before anything is used: its header, its size against its token count, and its
largest id against the tokenizer's vocabulary (a `TokenFileError` naming the file and the
problem; then nothing is written anywhere). Once all are good, the largest id of each file is
remembered in the cache (keyed by the file's path, size and modification time), so a second
start reads no file whole.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
from typing import Any, NamedTuple, Sequence

from absl import logging
import numpy as np

from s24jax import destinations
from s24jax import errors

MAGIC = 20240520
MAGIC_LLAMA3 = 20240801   # llm.c's uint32 LLaMA 3 files (dev/data/data_common.py)
VERSION_UINT16 = 1
VERSION_UINT32 = 2
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
SUFFIX = '.bin'
_VAL_NAME = re.compile(r'(?:^|[^a-z])val(?:id|idation)?(?:[^a-z]|$)')
_CHUNK = 1 << 26   # tokens per chunk when scanning a file for its largest id


class TokenFileError(errors.UserError):
  """A token file that cannot be used as it is (the message names the file and the problem)."""


@dataclasses.dataclass(frozen=True)
class Shard:
  """One token file: where its ids start and how many there are."""
  path: pathlib.Path
  offset: int          # bytes before the first id (1024 with llm.c's header, else 0)
  count: int           # number of uint16 ids

  @property
  def has_header(self) -> bool:
    return self.offset > 0

  def open(self) -> np.ndarray:
    """The ids, a read-only memmap (no copy)."""
    return np.memmap(self.path, dtype=np.uint16, mode='r', offset=self.offset,
                     shape=(self.count,))


def inspect(path: str | os.PathLike[str]) -> Shard:
  """Reads and checks the layout of one token file (header, size)."""
  path = pathlib.Path(path)
  try:
    size = path.stat().st_size
    with open(path, 'rb') as f:
      head = f.read(HEADER_BYTES)
  except OSError as e:
    raise TokenFileError(f'token file {path}: cannot be read ({e})') from None
  if size == 0:
    raise TokenFileError(f'token file {path}: empty')
  first = np.frombuffer(head[:4], dtype='<i4')[0] if len(head) >= 4 else None
  if first == MAGIC:
    if len(head) < HEADER_BYTES:
      raise TokenFileError(f'token file {path}: starts with llm.c\'s magic {MAGIC} but holds '
                           f'{size} bytes, less than its {HEADER_BYTES}-byte header (truncated)')
    header = np.frombuffer(head, dtype='<i4')
    version, count = int(header[1]), int(header[2])
    if version == VERSION_UINT32:
      raise TokenFileError(f'token file {path}: llm.c version 2 (uint32 LLaMA-3 token ids); '
                           's24jax reads version 1, uint16 GPT-2 ids')
    if version != VERSION_UINT16:
      raise TokenFileError(f'token file {path}: llm.c header with unknown version {version} '
                           f'(expected {VERSION_UINT16}, uint16 ids)')
    expected = HEADER_BYTES + 2 * count
    if count <= 0 or size != expected:
      raise TokenFileError(f'token file {path}: corrupt: its header says {count} tokens '
                           f'({expected} bytes with the header) but the file has {size} bytes')
    return Shard(path, HEADER_BYTES, count)
  if len(head) == HEADER_BYTES:
    _check_not_a_foreign_header(path, size, np.frombuffer(head, dtype='<i4'))
  if size % 2:
    raise TokenFileError(f'token file {path}: {size} bytes, an odd number: not uint16 token '
                         f'ids (nor an llm.c file: no magic {MAGIC} in its first 4 bytes)')
  return Shard(path, 0, size // 2)


def _check_not_a_foreign_header(path: pathlib.Path, size: int, header: np.ndarray) -> None:
  """A file whose first 1024 bytes read as llm.c's header (a known version, a token count
  that gives the file's size) but with another magic: a damaged or foreign header, not raw
  ids (whose first ids would otherwise be reported as another tokenizer's)."""
  if int(header[0]) == MAGIC_LLAMA3:
    raise TokenFileError(f'token file {path}: llm.c\'s LLaMA 3 layout (magic {MAGIC_LLAMA3}, '
                         f'uint32 ids); s24jax reads GPT-2 uint16 ids (magic {MAGIC})')
  version, count = int(header[1]), int(header[2])
  width = {VERSION_UINT16: 2, VERSION_UINT32: 4}.get(version)
  if width and count > 0 and size == HEADER_BYTES + width * count:
    raise TokenFileError(
        f'token file {path}: its first {HEADER_BYTES} bytes are an llm.c header (version '
        f'{version}, {count} tokens, which is the file\'s size) but its magic is '
        f'{int(header[0])}, not llm.c\'s {MAGIC}: the header is damaged or from another '
        'tool. Rewrite the file (llm.c\'s write_datafile, or token_files.write_shard), or '
        'strip the header to keep raw uint16 ids')


def _header_hint(shard: Shard, n_vocab: int) -> str:
  """For a raw file whose first ids are out of the vocabulary: it may hold a header."""
  if shard.has_header or shard.count < 2:
    return ''
  first = np.asarray(shard.open()[:2])
  if (first >= n_vocab).any():
    return (f' Its first two ids ({int(first[0])}, {int(first[1])}) are out of range: if the '
            'file starts with a header (another tool\'s, or a damaged llm.c one), that is '
            'what is read as ids.')
  return ''


def _max_cache_file(cache_root: pathlib.Path | None, shard: Shard) -> pathlib.Path | None:
  if cache_root is None:
    return None
  st = shard.path.stat()
  key = f'{shard.path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{shard.offset}'
  return cache_root / 'token_files' / f'{hashlib.sha256(key.encode()).hexdigest()[:24]}.json'


def max_id(shard: Shard, cache_root: pathlib.Path | None = None) -> tuple[int, bool]:
  """(the largest id of the file, whether it was read from the memo in `cache_root`); read
  in chunks of the memmap."""
  memo = _max_cache_file(cache_root, shard)
  if memo is not None and memo.is_file():
    try:
      return int(json.loads(memo.read_text())['max_id']), True
    except (OSError, ValueError, KeyError):
      pass
  tokens = shard.open()
  top = 0
  for start in range(0, len(tokens), _CHUNK):
    top = max(top, int(tokens[start:start + _CHUNK].max()))
  return top, False


def remember_max_id(shard: Shard, top: int, cache_root: pathlib.Path | None) -> None:
  """Writes the memo; a cache folder that cannot be written only costs the next start a
  read of the file (a warning)."""
  memo = _max_cache_file(cache_root, shard)
  if memo is None:
    return
  try:
    memo.parent.mkdir(parents=True, exist_ok=True)
    destinations.write_atomic(memo, json.dumps({'path': str(shard.path), 'max_id': top}))
  except OSError as e:
    logging.warning('cannot remember the largest id of %s in %s (%s): the next start reads the '
                    'file again', shard.path, memo.parent, e.strerror or e)


def check_vocab(shard: Shard, top: int, n_vocab: int, tokenizer_name: str) -> None:
  """A TokenFileError if the file's largest id `top` is outside the tokenizer's ids."""
  if top >= n_vocab:
    raise TokenFileError(
        f'token file {shard.path}: holds token id {top}, outside the vocabulary of '
        f'config.data.tokenizer ({tokenizer_name}: ids 0..{n_vocab - 1}). Its ids come from '
        'another tokenizer; set config.data.tokenizer to the one that wrote it (gpt2: '
        'GPT-2\'s BPE, as nanoGPT and llm.c write; bytes: UTF-8 bytes).'
        + _header_hint(shard, n_vocab))


class ShardedTokens:
  """Several token arrays read as one flat stream, without a copy: what `batches` needs of
  a stream (len, ndim, integer-array and slice indexing). `np.asarray` of it reads every part
  into memory (batches.unigram_entropy does that once per run)."""

  def __init__(self, parts: Sequence[np.ndarray]):
    if not parts:
      raise ValueError('ShardedTokens needs at least one part')
    self.parts = list(parts)
    self.starts = np.cumsum([0] + [len(p) for p in self.parts]).astype(np.int64)

  ndim = 1
  dtype = np.dtype(np.uint16)

  @property
  def shape(self) -> tuple[int]:
    return (int(self.starts[-1]),)

  @property
  def size(self) -> int:
    return int(self.starts[-1])

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, key: Any) -> Any:
    n = len(self)
    if isinstance(key, slice):
      start, stop, step = key.indices(n)
      if step != 1:
        return self[np.arange(start, stop, step)]
      pieces = []
      for part, s in zip(self.parts, self.starts[:-1]):
        lo, hi = max(start - s, 0), min(stop - s, len(part))
        if lo < hi:
          pieces.append(np.asarray(part[lo:hi]))
      return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)
    if isinstance(key, (int, np.integer)):
      i = int(key) + (n if key < 0 else 0)
      if not 0 <= i < n:
        raise IndexError(f'index {key} out of range for {n} tokens')
      p = int(np.searchsorted(self.starts, i, side='right')) - 1
      return self.parts[p][i - self.starts[p]]
    idx = np.asarray(key)
    if not np.issubdtype(idx.dtype, np.integer):
      raise TypeError(f'ShardedTokens indices must be integers, got {idx.dtype}')
    idx = np.where(idx < 0, idx + n, idx)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
      raise IndexError(f'index out of range for {n} tokens')
    out = np.empty(idx.shape, self.dtype)
    which = np.searchsorted(self.starts, idx, side='right') - 1
    for p in np.unique(which):
      sel = which == p
      out[sel] = self.parts[p][idx[sel] - self.starts[p]]
    return out

  def __array__(self, dtype=None, copy=None):
    del copy
    out = np.concatenate([np.asarray(p) for p in self.parts])
    return out if dtype is None else out.astype(dtype)


def stream(parts: Sequence[np.ndarray]) -> Any:
  """One part as it is (the memmap), several as a ShardedTokens."""
  return parts[0] if len(parts) == 1 else ShardedTokens(parts)


def is_val_name(path: pathlib.Path) -> bool:
  return bool(_VAL_NAME.search(path.name.lower()))


def list_files(path: str | os.PathLike[str]) -> list[pathlib.Path]:
  """The .bin files of a folder (recursively, in path order), or the one file given."""
  p = pathlib.Path(path).expanduser()
  if p.is_file():
    return [p]
  if not p.is_dir():
    raise TokenFileError(f'config.data.path={str(path)!r}: no such file or folder')
  files = sorted(f for f in p.rglob(f'*{SUFFIX}') if f.is_file())
  if not files:
    raise TokenFileError(f'no {SUFFIX} token files under {p}')
  return files


def fingerprint(files: Sequence[pathlib.Path]) -> str:
  """A hash of the files' paths, sizes and modification times (stat only)."""
  h = hashlib.sha256()
  for f in files:
    st = f.stat()
    h.update(f'\0{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}'.encode())
  return h.hexdigest()[:16]


class Streams(NamedTuple):
  train: Any        # a memmap, or a ShardedTokens of several
  val: Any
  max_id: int       # the largest id in any file


def token_streams(path: str | os.PathLike[str], *, n_vocab: int, tokenizer_name: str,
                  val_fraction: float, cache_root: pathlib.Path | None = None) -> Streams:
  """The (train, val) token streams of the files at `path` (module docstring), every file
  checked first: one bad file raises TokenFileError and nothing is written."""
  files = list_files(path)
  shards = [inspect(f) for f in files]
  tops = [max_id(s, cache_root) for s in shards]
  for s, (top, _) in zip(shards, tops):
    check_vocab(s, top, n_vocab, tokenizer_name)
  for s, (top, remembered) in zip(shards, tops):   # all files good: remember their largest id
    if not remembered:
      remember_max_id(s, top, cache_root)
  val = [s for s in shards if is_val_name(s.path)]
  train = [s for s in shards if not is_val_name(s.path)]
  if not train:
    raise TokenFileError(f'{path}: only validation files ({", ".join(s.path.name for s in val)})'
                         '; the training stream needs at least one file whose name does not '
                         'say val')
  train_parts = [s.open() for s in train]
  if val:
    val_parts = [s.open() for s in val]
  else:
    total = sum(s.count for s in train)
    n_val = int(round(val_fraction * total))
    last = train_parts[-1]
    if not 0 < n_val < len(last):
      raise TokenFileError(
          f'{path}: no validation file (a name with val), and holding out '
          f'val_fraction={val_fraction} of the {total} training tokens ({n_val}) does not fit '
          f'in the last file ({len(last)} tokens). Add a validation file.')
    logging.info('%s: no validation file; holding out the last %d tokens of %s', path, n_val,
                 train[-1].path.name)
    train_parts[-1], val_parts = last[:len(last) - n_val], [last[len(last) - n_val:]]
  logging.info('token files %s: train %d tokens in %d files, val %d tokens (memory-mapped)',
               path, sum(len(p) for p in train_parts), len(train), sum(len(p) for p in val_parts))
  return Streams(stream(train_parts), stream(val_parts), max(top for top, _ in tops))


def write_shard(path: str | os.PathLike[str], tokens: Any, *, header: bool = True) -> pathlib.Path:
  """Writes ids as llm.c does (`write_datafile`: the 256-int32 header, then uint16 ids) or,
  header=False, as nanoGPT does (the raw uint16 ids); whole or not at all."""
  tokens = np.asarray(tokens)
  if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 16):
    raise ValueError('uint16 token files hold ids 0..65535')
  path = pathlib.Path(path)
  with destinations.atomic_file(path, 'wb') as f:
    if header:
      h = np.zeros(HEADER_INTS, dtype='<i4')
      h[0], h[1], h[2] = MAGIC, VERSION_UINT16, tokens.size
      f.write(h.tobytes())
    f.write(tokens.astype('<u2').tobytes())
  return path
