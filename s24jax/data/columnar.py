"""Folders of JSONL or Parquet files with a text column: how FineWeb and most Hugging Face
corpora come. Each record is one document; they are tokenized once into the token cache, like
a folder of .txt files (s24jax/data/cache.py).

- `.jsonl` / `.jsonl.gz`: one JSON object per line, the text under `config.data.text_key`
  (default 'text');
- `.parquet`: the column `config.data.text_key`, a string column, read in record batches
  with pyarrow (installed with tensorflow-datasets).
Null or blank texts are skipped (as empty .txt files are). The split: files whose name says
val / valid / validation / test are the validation documents; with none, each document goes
to validation when a hash of (its file's relative path, its row) is below
`config.data.val_fraction`, so the split depends on nothing else.

Every file is checked before the first token is written (`check_files`: a Parquet file's
schema has the column, as a string; every JSONL line parses and holds a string under the
key), so a bad file stops the preparation with a `TextFileError` naming the file, the line or
column, and the problem, before any cache file is written.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import pathlib
import re
from typing import Iterator, Sequence

from s24jax import errors
from s24jax.data import text_corpus

JSONL = 'jsonl'
PARQUET = 'parquet'
KINDS = (JSONL, PARQUET)
SUFFIXES = {JSONL: ('.jsonl', '.jsonl.gz'), PARQUET: ('.parquet',)}
_VAL_NAME = re.compile(r'(?:^|[^a-z])(?:val(?:id|idation)?|test)(?:[^a-z]|$)')
_BATCH_ROWS = 4096


class TextFileError(errors.UserError):
  """A JSONL or Parquet file that cannot be read as documents (the message names it)."""


def kind_of(path: pathlib.Path) -> str | None:
  name = path.name.lower()
  for kind, suffixes in SUFFIXES.items():
    if name.endswith(suffixes):
      return kind
  return None


def list_files(path: str | os.PathLike[str], kind: str) -> list[pathlib.Path]:
  """The files of `kind` under a folder (recursively, in path order), or the one file given."""
  p = pathlib.Path(path).expanduser()
  if p.is_file():
    if kind_of(p) != kind:
      raise TextFileError(f'{p}: not a {kind} file ({", ".join(SUFFIXES[kind])})')
    return [p]
  if not p.is_dir():
    raise TextFileError(f'config.data.path={str(path)!r}: no such file or folder')
  files = sorted(f for f in p.rglob('*') if f.is_file() and kind_of(f) == kind)
  if not files:
    raise TextFileError(f'no {kind} files ({", ".join(SUFFIXES[kind])}) under {p}')
  return files


def fingerprint(files: Sequence[pathlib.Path]) -> str:
  """A hash of the files' paths, sizes and modification times (stat only): any change to a
  file gives a new cache entry."""
  h = hashlib.sha256()
  for f in files:
    st = f.stat()
    h.update(f'\0{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}'.encode())
  return h.hexdigest()[:16]


def is_val_name(path: pathlib.Path) -> bool:
  return bool(_VAL_NAME.search(path.name.lower()))


# ---------------------------------------------------------------------------------------------
# Reading.


def _jsonl_lines(path: pathlib.Path) -> Iterator[str]:
  opener = gzip.open if path.name.lower().endswith('.gz') else open
  try:
    with opener(path, 'rt', encoding='utf-8') as f:
      yield from f
  except (OSError, EOFError, UnicodeDecodeError) as e:
    raise TextFileError(f'{path}: cannot be read as UTF-8 JSON lines ({type(e).__name__}: '
                        f'{e})') from None


def _jsonl_texts(path: pathlib.Path, text_key: str) -> Iterator[str | None]:
  for n, line in enumerate(_jsonl_lines(path), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except ValueError as e:
      raise TextFileError(f'{path}, line {n}: not JSON ({e})') from None
    if not isinstance(record, dict) or text_key not in record:
      keys = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise TextFileError(f'{path}, line {n}: no {text_key!r} field (it has {keys}); set '
                          'config.data.text_key')
    text = record[text_key]
    if text is not None and not isinstance(text, str):
      raise TextFileError(f'{path}, line {n}: {text_key!r} is a {type(text).__name__}, not '
                          'a string')
    yield text


def _parquet_file(path: pathlib.Path, text_key: str):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top (only for Parquet sources)
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  try:
    f = pq.ParquetFile(path)
  except (OSError, pa.ArrowException) as e:
    raise TextFileError(f'{path}: not a readable Parquet file ({e})') from None
  schema = f.schema_arrow
  if text_key not in schema.names:
    raise TextFileError(f'{path}: no column {text_key!r} (its columns: {schema.names}); set '
                        'config.data.text_key')
  column_type = schema.field(text_key).type
  if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
    raise TextFileError(f'{path}: column {text_key!r} is {column_type}, not a string column')
  return f


def _parquet_texts(path: pathlib.Path, text_key: str) -> Iterator[str | None]:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  f = _parquet_file(path, text_key)
  try:
    for batch in f.iter_batches(batch_size=_BATCH_ROWS, columns=[text_key]):
      yield from batch.column(0).to_pylist()
  except (OSError, pa.ArrowException) as e:
    raise TextFileError(f'{path}: corrupt Parquet data ({e})') from None


def texts(path: pathlib.Path, kind: str, text_key: str) -> Iterator[str | None]:
  """The text of every record of one file, in order (None for a null text)."""
  return _jsonl_texts(path, text_key) if kind == JSONL else _parquet_texts(path, text_key)


def check_files(files: Sequence[pathlib.Path], kind: str, text_key: str) -> None:
  """Raises TextFileError for the first bad file: Parquet by its schema and metadata, JSONL
  by reading every line."""
  for f in files:
    if kind == PARQUET:
      _parquet_file(f, text_key)
    else:
      for _ in _jsonl_texts(f, text_key):
        pass


def documents(files: Sequence[pathlib.Path], root: pathlib.Path, kind: str, text_key: str,
              val_fraction: float, split: str, max_docs: int | None = None
              ) -> Iterator[tuple[str, str]]:
  """(title 'relative/path.jsonl:row', text) of the split's documents (docstring: the split)."""
  by_name = any(is_val_name(f) for f in files)
  taken = 0
  for f in files:
    rel = f.relative_to(root).as_posix() if f != root else f.name
    if by_name and (is_val_name(f) != (split == 'val')):
      continue
    for row, text in enumerate(texts(f, kind, text_key)):
      if text is None or not text.strip():
        continue
      if not by_name:
        held_out = text_corpus.unit_hash(f'{rel}:{row}') < val_fraction
        if held_out != (split == 'val'):
          continue
      yield f'{rel}:{row}', text
      taken += 1
      if max_docs is not None and taken >= max_docs:
        return
