"""Tests for s24jax/data/cache.py, the token cache (`load_tokens`): an entry reused while its
source is unchanged and invalidated when it changes, one entry per tokenizer, rebuilt with a
warning when a file no longer matches the checksum written with it (zeroed at the same size,
truncated), the checksum's sampled form for large files, the loop's refusal of a model
vocabulary smaller than the cache's tokenizer (`validate.load_tokens`), and a full disk
during a build (tests/faults.py), which leaves no entry that looks valid nor a temporary file.
References: the TFDS dataset read back with the public TFDS API, the UTF-8 bytes of its
documents, the .txt files written here and their GPT-2 BPE plus <|endoftext|>, hashlib over
chosen blocks."""

from __future__ import annotations

import errno
import hashlib
import logging
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds

from s24jax.training import config as config_lib
from s24jax.training import validate
from s24jax.data import cache
from s24jax.data import sources
from s24jax.data import text_corpus
from s24jax.data import tokenizer

from data_helpers import FOLDER_DOCS, cfg, make_folder, reference_stream
from faults import Faults


def bpe_key(cache_dir) -> str:
  return cache.token_cache_meta(cfg(cache_dir=str(cache_dir)))['key']['tokenizer']


def test_byte_tokens_of_the_embedded_corpus(shakespeare):
  cache_dir, bpe = shakespeare
  data = cfg(cache_dir=str(cache_dir))
  data.tokenizer = 'bytes'
  tokens = cache.load_tokens(data)
  ds = tfds.data_source('s24jax_text_corpus/shakespeare', data_dir=str(cache_dir / 'tfds'))
  expected = b''.join(r['text'] + b'\0' for r in ds['validation'])   # \0 marks the separator
  ref = np.frombuffer(expected, np.uint8).astype(np.uint16)
  ref[ref == 0] = 256
  np.testing.assert_array_equal(np.asarray(tokens.val), ref)
  assert tokens.vocab_size == 257 and len(tokens.train) > 3 * len(bpe.train)
  assert cache.token_cache_meta(data)['key']['tokenizer'] != bpe_key(cache_dir)


def test_model_vocab_smaller_than_the_tokenizer_is_refused(shakespeare):
  cache_dir, _ = shakespeare
  config = config_lib.base_config()
  config.data.cache_dir = str(cache_dir)
  config.model.vocab_size = 320          # the small variant's, with the GPT-2 BPE
  with pytest.raises(ValueError, match='50257 token ids.*vocab_size >= 50257'):
    validate.load_tokens(config)


def test_cache_reused_then_invalidated_by_folder_change(tmp_path, monkeypatch):
  folder = make_folder(tmp_path)
  c = cfg(path=str(folder), cache_dir=str(tmp_path / 'cache'))
  first = cache.load_tokens(c)
  train_file = pathlib.Path(first.train.filename)
  mtime = train_file.stat().st_mtime_ns

  def must_not_run(*args, **kwargs):
    raise AssertionError('The token cache was rebuilt although nothing changed.')

  with monkeypatch.context() as m:
    m.setattr(cache, '_write_split', must_not_run)
    m.setattr(text_corpus.TextCorpus, 'download_and_prepare', must_not_run)
    second = cache.load_tokens(c)
  assert pathlib.Path(second.train.filename) == train_file
  assert train_file.stat().st_mtime_ns == mtime
  np.testing.assert_array_equal(np.asarray(second.train), np.asarray(first.train))

  # Appending to a document must produce a new cache holding the new text.
  meta = cache.token_cache_meta(c)
  title = meta['splits']['train']['titles'][0]
  extra = ' Freshly appended sentence about marmosets.'
  with open(folder / title, 'a', encoding='utf-8') as f:
    f.write(extra)
  assert cache.token_cache_meta(c) is None  # The old entry no longer matches.
  third = cache.load_tokens(c)
  assert pathlib.Path(third.train.filename) != train_file
  texts = {t: (folder / t).read_text(encoding='utf-8')
           for t in cache.token_cache_meta(c)['splits']['train']['titles']}
  assert extra in texts[title]
  np.testing.assert_array_equal(np.asarray(third.train), reference_stream(list(texts.values())))


def test_a_changed_cache_file_is_rebuilt_with_a_warning(tmp_path, caplog):
  folder = make_folder(tmp_path)
  c = cfg(path=str(folder), cache_dir=str(tmp_path / 'cache'))
  first = cache.load_tokens(c)
  meta = cache.token_cache_meta(c)
  expected = reference_stream([FOLDER_DOCS[t] for t in meta['splits']['train']['titles']])
  assert first.max_id == max(int(expected.max()), int(np.asarray(first.val).max()))
  path = pathlib.Path(first.train.filename)
  for damage in ('zeroed at the same size', 'truncated'):
    if damage.startswith('zeroed'):
      path.write_bytes(bytes(path.stat().st_size))   # the size check alone passes this
      problem = 'changed since it was written'
    else:
      path.write_bytes(path.read_bytes()[:-2])
      problem = 'bytes, not the'
    assert cache.token_cache_meta(c) is None
    with caplog.at_level(logging.WARNING):
      again = cache.load_tokens(c)
    assert 'TOKEN CACHE REBUILT' in caplog.text and problem in caplog.text, caplog.text
    np.testing.assert_array_equal(np.asarray(again.train), expected)
    caplog.clear()


def test_the_checksum_of_a_large_file_samples_evenly_spaced_blocks(tmp_path, monkeypatch):
  monkeypatch.setattr(cache, 'FULL_HASH_BYTES', 1000)
  monkeypatch.setattr(cache, 'SAMPLE_BLOCKS', 4)
  monkeypatch.setattr(cache, 'SAMPLE_BLOCK_BYTES', 10)
  data = bytearray(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
  path = tmp_path / 'big.bin'
  path.write_bytes(bytes(data))
  # By hand: the size, then 10 bytes at 0, 1330, 2660, 3990 (the last block ends the file).
  h = hashlib.blake2b(b'4000', digest_size=16)
  for start in (0, 1330, 2660, 3990):
    h.update(bytes(data[start:start + 10]))
  assert cache.file_checksum(path) == f'blake2b-sampled:{h.hexdigest()}'
  data[1335] ^= 1                     # inside a sampled block: seen
  path.write_bytes(bytes(data))
  assert cache.file_checksum(path) != f'blake2b-sampled:{h.hexdigest()}'
  small = tmp_path / 'small.bin'      # up to FULL_HASH_BYTES: every byte
  small.write_bytes(bytes(data[:1000]))
  whole = hashlib.blake2b(b'1000', digest_size=16)
  whole.update(bytes(data[:1000]))
  assert cache.file_checksum(small) == f'blake2b:{whole.hexdigest()}'


HAND_DOCS = {'train': [('a', 'the first document, ' * 10), ('b', 'naïve')], 'val': [('c', 'held')]}
PROBE_BYTES = 4096   # destinations.probe: what the folder check writes (and removes)


def _byte_ids(docs) -> np.ndarray:
  """The bytes tokenizer's stream, by hand: each document's UTF-8 bytes, then 256."""
  return np.asarray([i for _, text in docs for i in [*text.encode('utf-8'), 256]], np.uint16)


@pytest.mark.parametrize('cut_in', ['train.bin', 'meta.json'])
def test_a_full_disk_during_a_build_leaves_no_entry_that_looks_valid(cut_in, tmp_path,
                                                                      monkeypatch):
  """The disk fills (tests/faults.py: a short write, then ENOSPC) in the first split, or in
  the sidecar once both splits are written: no sidecar, no temporary file, no part of a file;
  once space is freed the entry is built whole."""
  source = sources.Source(name='hand', key={'hand': 1},
                          open_splits=lambda: {s: iter(d) for s, d in HAND_DOCS.items()})
  enc = tokenizer.by_name('bytes')
  splits_bytes = sum(2 * len(_byte_ids(d)) for d in HAND_DOCS.values())
  root = tmp_path / 'cache'
  root.mkdir()
  with monkeypatch.context() as m:
    free = PROBE_BYTES + (100 if cut_in == 'train.bin' else splits_bytes + 10)
    Faults(m).full(root, ops=('write',), free_bytes=free)   # its folders can still be made
    with pytest.raises(OSError) as e:
      cache.prepare_token_cache(source, root, enc)
  assert e.value.errno == errno.ENOSPC
  left = sorted(p.name for p in root.rglob('*') if p.is_file())
  assert left == ([] if cut_in == 'train.bin' else ['train.bin', 'val.bin']), left
  directory, meta = cache.prepare_token_cache(source, root, enc)
  for split, docs in HAND_DOCS.items():
    np.testing.assert_array_equal(np.fromfile(directory / f'{split}.bin', np.uint16),
                                  _byte_ids(docs))
    assert meta['splits'][split]['num_docs'] == len(docs)
  assert sorted(p.name for p in directory.iterdir()) == ['meta.json', 'train.bin', 'val.bin']
