"""Tests for s24jax/data/sources.py: which source `config.data` names (text folder, any
prepared TFDS text dataset, an unknown name) and its documents, driven through
`cache.load_tokens`. References: a toy TFDS dataset registered and prepared here, read back
with the public TFDS API, and the GPT-2 BPE of each document plus <|endoftext|>."""

from __future__ import annotations

from etils import epath
import numpy as np
import pytest
import tensorflow_datasets as tfds

from s24jax.data import cache
from s24jax.data import sources

from data_helpers import cfg, reference_stream


def test_text_folder_name_requires_path(tmp_path):
  with pytest.raises(ValueError, match='needs config.data.path'):
    cache.load_tokens(cfg(name='text_folder', cache_dir=str(tmp_path)))


# ----------------------------------------------------------------------------------------------
# Any TFDS dataset by name.
# ----------------------------------------------------------------------------------------------


class S24jaxTestToyText(tfds.core.GeneratorBasedBuilder):
  """A registered TFDS text dataset with train and test splits, standing in for lm1b."""

  VERSION = tfds.core.Version('0.1.0')

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):
    return epath.Path(__file__)  # See the note in s24jax/data/text_corpus.py.

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, features=tfds.features.FeaturesDict({'sentence': tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples('train', 12),
            'test': self._generate_examples('test', 3)}

  def _generate_examples(self, split, n):
    for i in range(n):
      yield f'{split}{i}', {'sentence': f'{split} sentence number {i}, with words.'}


def test_prepared_tfds_dataset_by_name(tmp_path):
  data_dir = tmp_path / 'tfds'
  builder = S24jaxTestToyText(data_dir=str(data_dir), file_format='array_record')
  builder.download_and_prepare()
  c = cfg(name='s24jax_test_toy_text', tfds_data_dir=str(data_dir), text_key='sentence',
          cache_dir=str(tmp_path / 'cache'), max_docs=5)
  tokens = cache.load_tokens(c)
  ds = builder.as_data_source()
  train_texts = [r['sentence'].decode() for r in ds['train']][:5]  # max_docs caps each split.
  val_texts = [r['sentence'].decode() for r in ds['test']]  # 'test' stands in for validation.
  np.testing.assert_array_equal(np.asarray(tokens.train), reference_stream(train_texts))
  np.testing.assert_array_equal(np.asarray(tokens.val), reference_stream(val_texts))
  with pytest.raises(ValueError, match="no feature 'text'"):
    cache.load_tokens(cfg(name='s24jax_test_toy_text', tfds_data_dir=str(data_dir),
                          cache_dir=str(tmp_path / 'cache2')))


def test_unprepared_tfds_dataset_gives_clear_error(tmp_path):
  data_dir = tmp_path / 'empty_tfds'
  with pytest.raises(FileNotFoundError) as info:
    cache.load_tokens(cfg(name='lm1b', tfds_data_dir=str(data_dir),
                          cache_dir=str(tmp_path / 'cache')))
  message = str(info.value)
  assert "'lm1b'" in message and str(data_dir) in message
  assert 'tfds_data_dir' in message and 'tfds build lm1b' in message


def test_unknown_dataset_lists_valid_names(tmp_path):
  with pytest.raises(ValueError) as info:
    cache.load_tokens(cfg(name='shakespear', cache_dir=str(tmp_path)))
  message = str(info.value)
  for name in sources.EMBEDDED_DATASETS:
    assert name in message
  assert 'Any TFDS text dataset name' in message
  assert 'Did you mean: shakespeare' in message


# ----------------------------------------------------------------------------------------------
# Files at config.data.path: which source a path is.
# ----------------------------------------------------------------------------------------------


def test_path_kind_of_folders_and_files(tmp_path):
  (tmp_path / 'txt').mkdir()
  (tmp_path / 'txt' / 'a.txt').write_text('text')
  (tmp_path / 'txt' / 'b.bin').write_bytes(b'\0\0')        # .txt wins: the existing behaviour
  (tmp_path / 'bins' / 'deep').mkdir(parents=True)
  (tmp_path / 'bins' / 'deep' / 'train.bin').write_bytes(b'\0\0')
  (tmp_path / 'js').mkdir()
  (tmp_path / 'js' / 'a.jsonl.gz').write_bytes(b'')
  (tmp_path / 'pq').mkdir()
  (tmp_path / 'pq' / 'a.parquet').write_bytes(b'')
  (tmp_path / 'mixed').mkdir()
  (tmp_path / 'mixed' / 'a.parquet').write_bytes(b'')
  (tmp_path / 'mixed' / 'b.bin').write_bytes(b'')
  (tmp_path / 'empty').mkdir()
  kinds = {name: sources.path_kind(str(tmp_path / name))
           for name in ('txt', 'bins', 'js', 'pq', 'empty', 'missing')}
  assert kinds == {'txt': 'text_folder', 'bins': 'token_files', 'js': 'jsonl', 'pq': 'parquet',
                   'empty': 'text_folder', 'missing': 'text_folder'}
  assert sources.path_kind(str(tmp_path / 'pq' / 'a.parquet')) == 'parquet'
  assert sources.path_kind(str(tmp_path / 'bins' / 'deep' / 'train.bin')) == 'token_files'
  with pytest.raises(ValueError, match='holds parquet and token_files files; set config.data.name'):
    sources.path_kind(str(tmp_path / 'mixed'))


def test_file_source_names_need_a_path_and_other_names_refuse_one(tmp_path):
  for name in sources.FILE_SOURCES:
    with pytest.raises(ValueError, match=f"name='{name}' needs config.data.path"):
      sources.resolve_source(cfg(name=name))
  with pytest.raises(ValueError, match="only used with name='text_folder' .or token_files"):
    sources.resolve_source(cfg(name='lm1b', path=str(tmp_path)))
  with pytest.raises(ValueError, match='files at config.data.path: token_files, jsonl, parquet'):
    cache.load_tokens(cfg(name='shakespear', cache_dir=str(tmp_path)))
