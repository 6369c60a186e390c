"""Tests for s24jax/data/batches.py: training batches keyed by (seed, step), evaluation
batches, and the unigram / bigram entropies of a token stream. References: token streams
whose value is their position (windows are readable), and hand-computed entropies."""

from __future__ import annotations

import math

import numpy as np
import pytest

from s24jax.data import batches


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
