"""The token cache: each source tokenized once into flat uint16 files, one per split, then
memory-mapped (`load_tokens`, the training loop's entry point).

Documents are concatenated, each followed by <|endoftext|>. An entry is keyed by everything that
determines its content (the source's key, the tokenizer, the cache format) and written under
temporary names, then synced and renamed (destinations.atomic_file), the sidecar last, so that
a crash, a full disk or two processes preparing at once never leave a half-written entry that
looks valid, nor a temporary file.

The sidecar records each split's size, largest token id and checksum (`file_checksum`: BLAKE2b
of the whole file up to FULL_HASH_BYTES, of SAMPLE_BLOCKS evenly spaced blocks beyond, so
that a start costs at most ~64 MiB of reading whatever the corpus), and every open checks
them: a file changed since it was written (truncated, overwritten, zeroed) is rebuilt with a
warning instead of being trained on. The cache folder is checked before a build (a file in
its way, a folder this process cannot write: one line naming config.data.cache_dir), never
read as a damaged entry.

`TokenData.fingerprint` identifies the tokens a run trains on (the splits' checksums; for
token files, their paths, sizes and modification times): a resumed run compares it with the
one its workdir recorded (s24jax/training/workdir.py) and says when the data changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
import time
from typing import Any, Iterable

from absl import logging
import numpy as np

from s24jax import destinations
from s24jax.data import sources
from s24jax.data import tokenizer

# Bump when the cache layout or the way documents become tokens changes: old caches are ignored.
# 2: the sidecar holds each split's checksum and largest id.
CACHE_FORMAT = 2
# file_checksum: files up to this size are hashed whole; larger ones by SAMPLE_BLOCKS blocks.
FULL_HASH_BYTES = 256 << 20
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 64, 1 << 20
_SPLITS = ('train', 'val')
_DOC_CHUNK = 64  # Documents per tokenizer call (tiktoken batches them over threads).


def cache_key(source_key: dict[str, Any], tok: tokenizer.Tokenizer) -> dict[str, Any]:
  """Everything that determines the cached tokens; any change gives a new cache entry."""
  return {'format': CACHE_FORMAT, 'tokenizer': tok.name, **source_key}


def cache_path(root: pathlib.Path, name: str, key: dict[str, Any]) -> pathlib.Path:
  """<root>/tokens/<readable name>-<hash of the key>."""
  digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
  slug = re.sub(r'[^A-Za-z0-9]+', '_', name.split(':')[0]).strip('_')[:40] or 'data'
  return root / 'tokens' / f'{slug}-{digest[:16]}'


def file_checksum(path: pathlib.Path) -> str:
  """A checksum of the file's size and bytes: all of them up to FULL_HASH_BYTES, else
  SAMPLE_BLOCKS blocks evenly spaced from the first to the last byte (a truncated, zeroed or
  overwritten region of a few MiB or more changes it; a single flipped byte of a huge file may
  not)."""
  size = path.stat().st_size
  h = hashlib.blake2b(str(size).encode(), digest_size=16)
  with open(path, 'rb') as f:
    if size <= FULL_HASH_BYTES:
      for chunk in iter(lambda: f.read(1 << 22), b''):
        h.update(chunk)
      return f'blake2b:{h.hexdigest()}'
    last = size - SAMPLE_BLOCK_BYTES
    for i in range(SAMPLE_BLOCKS):
      f.seek(last * i // (SAMPLE_BLOCKS - 1))
      h.update(f.read(SAMPLE_BLOCK_BYTES))
  return f'blake2b-sampled:{h.hexdigest()}'


def _write_split(path: pathlib.Path, docs: Iterable[sources.Doc],
                 enc: tokenizer.Tokenizer) -> dict[str, Any]:
  """Tokenizes documents straight to `path` (streamed into destinations.atomic_file: whole or
  not at all); returns counts, titles, the largest id and the checksum.

  Text is encoded as ordinary text: a literal '<|endoftext|>' inside a document does not become
  the separator token, so documents can only be delimited by the EOT we append.
  """
  num_tokens, num_docs, titles, max_id = 0, 0, [], -1
  with destinations.atomic_file(path, 'wb') as f:
    batch: list[sources.Doc] = []

    def flush() -> None:
      nonlocal num_tokens, max_id
      for ids in enc.encode_ordinary_batch([text for _, text in batch]):
        ids.append(enc.eot_token)
        # [doc_len + 1]. f.write, not ndarray.tofile: tofile writes through a C stdio stream
        # of its own, whose failure (a full disk) is an OSError without an errno.
        f.write(np.asarray(ids, dtype=np.uint16).tobytes())
        num_tokens += len(ids)
        max_id = max(max_id, max(ids))
      batch.clear()

    for title, text in docs:
      batch.append((title, text))
      titles.append(title)
      num_docs += 1
      if len(batch) == _DOC_CHUNK:
        flush()
    flush()
    f.flush()
    checksum = file_checksum(pathlib.Path(f.name))   # of the bytes written here
  return {'num_tokens': num_tokens, 'num_docs': num_docs, 'titles': titles,
          'max_id': max_id, 'checksum': checksum}


def _check_entry(directory: pathlib.Path, key: dict[str, Any]
                 ) -> tuple[dict[str, Any] | None, str | None]:
  """(the sidecar, None) if the cache entry is complete, matches `key` and its files match
  their sizes and checksums; else (None, what is wrong), the problem None when there is simply
  no entry yet."""
  try:
    meta = json.loads((directory / 'meta.json').read_text())
  except FileNotFoundError:
    return None, None
  except (OSError, ValueError) as e:
    return None, f'its meta.json cannot be read ({e})'
  if meta.get('key') != json.loads(json.dumps(key, default=str)):
    return None, 'its meta.json belongs to another entry'
  for split in _SPLITS:
    f = directory / f'{split}.bin'
    info = meta.get('splits', {}).get(split, {})
    if not f.is_file():
      return None, f'{f.name} is missing'
    if f.stat().st_size != 2 * info.get('num_tokens', -1):
      return None, (f'{f.name} has {f.stat().st_size} bytes, not the '
                    f'{2 * info.get("num_tokens", -1)} it was written with')
    if info.get('checksum') != file_checksum(f):
      return None, f'{f.name} changed since it was written (its checksum differs)'
  return meta, None


def _read_meta(directory: pathlib.Path, key: dict[str, Any]) -> dict[str, Any] | None:
  """The sidecar if the cache entry is complete, matches `key` and passes its checks."""
  return _check_entry(directory, key)[0]


CACHE_FLAG = 'config.data.cache_dir (else $S24JAX_CACHE, else ~/.cache/s24jax)'


def check_cache_root(root: pathlib.Path) -> None:
  """A DestinationError if a file stands where the cache folder (or a folder above it) is."""
  blocker = destinations.file_in_the_way(str(root / 'x'))
  if blocker:
    raise destinations.DestinationError(
        f'the token cache folder {root}: {blocker} is a file, not a folder; choose another '
        f'{CACHE_FLAG}')


def prepare_token_cache(source: sources.Source, root: pathlib.Path,
                        enc: tokenizer.Tokenizer | None = None
                        ) -> tuple[pathlib.Path, dict[str, Any]]:
  """Returns (cache dir, sidecar), tokenizing the source first if no valid cache exists.

  Files are written under temporary names and renamed, the sidecar last, so a crash mid-way or
  two processes preparing at once never leave a half-written entry that looks valid.
  """
  enc = enc or tokenizer.Gpt2Tokenizer()
  key = cache_key(source.key, enc)
  directory = cache_path(root, source.name, key)
  check_cache_root(root)
  meta, problem = _check_entry(directory, key)
  if meta is not None:
    logging.info('Token cache hit for %s: %s', source.name, directory)
    return directory, meta
  destinations.check_folder(str(directory), what='the token cache', flag=CACHE_FLAG)
  if problem:
    logging.warning('TOKEN CACHE REBUILT: the entry for %s in %s failed its check: %s. '
                    'Tokenizing the source again.', source.name, directory, problem)
  start = time.perf_counter()
  directory.mkdir(parents=True, exist_ok=True)
  splits_docs = source.open_splits()
  splits = {s: _write_split(directory / f'{s}.bin', splits_docs[s], enc) for s in _SPLITS}
  for split, info in splits.items():
    if info['num_docs'] == 0:
      raise ValueError(f'Dataset {source.name!r} has no documents in its {split} split.')
  meta = {
      'key': json.loads(json.dumps(key, default=str)),
      'source': source.name,
      'vocab_size': enc.n_vocab,
      'dtype': 'uint16',
      'seconds': round(time.perf_counter() - start, 3),
      'splits': {s: {'num_tokens': i['num_tokens'], 'num_docs': i['num_docs'],
                     'max_id': i['max_id'], 'checksum': i['checksum'],
                     # Titles make the split auditable; skipped for huge corpora.
                     'titles': i['titles'] if len(i['titles']) <= 10_000 else None}
                 for s, i in splits.items()},
  }
  destinations.write_atomic(directory / 'meta.json', json.dumps(meta, indent=1))
  logging.info(
      'Prepared %s in %.1fs: train %d tokens (%d docs), val %d tokens (%d docs) -> %s',
      source.name, meta['seconds'], splits['train']['num_tokens'], splits['train']['num_docs'],
      splits['val']['num_tokens'], splits['val']['num_docs'], directory)
  return directory, meta


@dataclasses.dataclass(frozen=True)
class TokenData:
  """Flat token streams of both splits (read-only uint16 memmaps) and where they came from."""
  train: np.ndarray  # [num_train_tokens] uint16
  val: np.ndarray  # [num_val_tokens] uint16
  vocab_size: int
  name: str
  max_id: int | None = None  # the largest id in either split (from the sidecar)
  fingerprint: str | None = None   # what the tokens are (module docstring)


def _digest(value: Any) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def data_tokenizer(data_cfg: Any) -> tokenizer.Tokenizer:
  """The tokenizer `config.data.tokenizer` names ('gpt2' where the field is absent)."""
  return tokenizer.by_name(getattr(data_cfg, 'tokenizer', None) or 'gpt2')


def load_tokens(data_cfg: Any) -> TokenData:
  """Prepares (once) and memory-maps the token streams described by `config.data`; a source
  of ready token ids (`Source.token_streams`: llm.c / nanoGPT files) is mapped as it is."""
  source = sources.resolve_source(data_cfg)
  enc = data_tokenizer(data_cfg)
  streams = getattr(source, 'token_streams', None)
  if streams is not None:
    train, val, max_id = streams(enc)
    return TokenData(train=train, val=val, vocab_size=enc.n_vocab, name=source.name,
                     max_id=int(max_id), fingerprint=_digest([source.key, enc.name]))
  root = sources.cache_root(getattr(data_cfg, 'cache_dir', None))
  directory, meta = prepare_token_cache(source, root, enc)
  arrays = {s: np.memmap(directory / f'{s}.bin', dtype=np.uint16, mode='r') for s in _SPLITS}
  max_id = max(meta['splits'][s]['max_id'] for s in _SPLITS)
  return TokenData(train=arrays['train'], val=arrays['val'], vocab_size=meta['vocab_size'],
                   name=source.name, max_id=max_id,
                   fingerprint=_digest([meta['splits'][s]['checksum'] for s in _SPLITS]))


def token_cache_meta(data_cfg: Any) -> dict[str, Any] | None:
  """The sidecar of the prepared cache for `data_cfg`, or None if it is not prepared yet."""
  source = sources.resolve_source(data_cfg)
  key = cache_key(source.key, data_tokenizer(data_cfg))
  root = sources.cache_root(getattr(data_cfg, 'cache_dir', None))
  return _read_meta(cache_path(root, source.name, key), key)
