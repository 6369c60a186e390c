"""Tests for s24jax/data/columnar.py: folders of JSONL and Parquet files with a text column,
tokenized into the token cache through `cache.load_tokens`. References: the files written here
(with json and pyarrow), their texts' GPT-2 BPE plus <|endoftext|> (data_helpers.
reference_stream), and the split restated (a file named val; else a hash of path and row)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from s24jax.data import cache
from s24jax.data import columnar
from s24jax.data import sources
from s24jax.data import text_corpus

from data_helpers import cfg, reference_stream

TRAIN = ['First document, plain.', 'Second: naïve café ☕', '  ', None, 'Third\nhas lines.']
VAL = ['A validation document.', 'And another one.']


def write_jsonl(path, texts, key='text', gz=False):
  lines = ''.join(json.dumps({key: t, 'id': i}) + '\n' for i, t in enumerate(texts))
  if gz:
    with gzip.open(path, 'wt', encoding='utf-8') as f:
      f.write(lines)
  else:
    path.write_text(lines, encoding='utf-8')
  return path


def write_parquet(path, texts, key='text'):
  pq.write_table(pa.table({key: pa.array(texts, pa.string()),
                           'n': pa.array(range(len(texts)), pa.int64())}), path)
  return path


def kept(texts):
  return [t for t in texts if t is not None and t.strip()]


@pytest.mark.parametrize('kind', ['jsonl', 'jsonl.gz', 'parquet'])
def test_named_split_tokenized_into_the_cache(kind, tmp_path):
  folder = tmp_path / 'corpus'
  (folder / 'sub').mkdir(parents=True)
  if kind == 'parquet':
    write_parquet(folder / 'train-00000.parquet', TRAIN[:3], key='content')
    write_parquet(folder / 'sub' / 'train-00001.parquet', TRAIN[3:], key='content')
    write_parquet(folder / 'validation-00000.parquet', VAL, key='content')
  else:
    gz = kind.endswith('.gz')
    suffix = '.jsonl.gz' if gz else '.jsonl'
    write_jsonl(folder / f'train_a{suffix}', TRAIN[:3], key='content', gz=gz)
    write_jsonl(folder / 'sub' / f'train_b{suffix}', TRAIN[3:], key='content', gz=gz)
    write_jsonl(folder / f'val{suffix}', VAL, key='content', gz=gz)
  (folder / 'README.md').write_text('not data')
  c = cfg(path=str(folder), text_key='content', cache_dir=str(tmp_path / 'cache'))
  source = sources.resolve_source(c)
  assert source.name.startswith(kind.split('.')[0] + ':')
  tokens = cache.load_tokens(c)
  # Files in path order: sub/train_b sorts before train_a.
  first, second = (TRAIN[3:], TRAIN[:3])
  np.testing.assert_array_equal(np.asarray(tokens.train), reference_stream(kept(first + second)))
  np.testing.assert_array_equal(np.asarray(tokens.val), reference_stream(VAL))
  assert cache.load_tokens(c).train.filename == tokens.train.filename   # cached once


def test_hash_split_without_validation_files(tmp_path):
  texts = [f'document number {i} with some words' for i in range(40)]
  write_jsonl(tmp_path / 'all.jsonl', texts)
  c = cfg(name='jsonl', path=str(tmp_path / 'all.jsonl'), val_fraction=0.25,
          cache_dir=str(tmp_path / 'cache'))
  tokens = cache.load_tokens(c)
  held_out = [text_corpus.unit_hash(f'all.jsonl:{i}') < 0.25 for i in range(40)]
  np.testing.assert_array_equal(np.asarray(tokens.val), reference_stream(
      [t for t, h in zip(texts, held_out) if h]))
  np.testing.assert_array_equal(np.asarray(tokens.train), reference_stream(
      [t for t, h in zip(texts, held_out) if not h]))
  assert 0 < sum(held_out) < 40


def test_parquet_without_the_text_column_is_named_and_nothing_is_written(tmp_path):
  folder = tmp_path / 'pq'
  folder.mkdir()
  write_parquet(folder / 'train.parquet', TRAIN)
  write_parquet(folder / 'val.parquet', VAL, key='body')
  with pytest.raises(columnar.TextFileError, match=r"val.parquet: no column 'text' .*body"):
    cache.load_tokens(cfg(path=str(folder), cache_dir=str(tmp_path / 'cache')))
  assert not (tmp_path / 'cache').exists()
  pq.write_table(pa.table({'text': pa.array([1, 2], pa.int64())}), folder / 'val.parquet')
  with pytest.raises(columnar.TextFileError, match="column 'text' is int64"):
    cache.load_tokens(cfg(path=str(folder), cache_dir=str(tmp_path / 'cache')))
  (folder / 'val.parquet').write_bytes(b'PAR1 not really')
  with pytest.raises(columnar.TextFileError, match='val.parquet: not a readable Parquet'):
    cache.load_tokens(cfg(path=str(folder), cache_dir=str(tmp_path / 'cache')))
  assert not (tmp_path / 'cache').exists()


@pytest.mark.parametrize('line, says', [
    ('{not json', 'line 3: not JSON'),
    ('{"body": "x"}', "line 3: no 'text' field"),
    ('{"text": 5}', "line 3: 'text' is a int"),
])
def test_bad_jsonl_line_is_named_and_no_token_file_is_written(line, says, tmp_path):
  folder = tmp_path / 'js'
  folder.mkdir()
  write_jsonl(folder / 'train.jsonl', TRAIN)
  path = write_jsonl(folder / 'val.jsonl', VAL)
  path.write_text(path.read_text() + line + '\n')
  with pytest.raises(columnar.TextFileError, match=says) as info:
    cache.load_tokens(cfg(path=str(folder), cache_dir=str(tmp_path / 'cache')))
  assert 'val.jsonl' in str(info.value)
  assert not [p for p in (tmp_path / 'cache').rglob('*') if p.is_file()]
