"""Batches of a flat token stream: training windows keyed by (seed, step), deterministic
evaluation windows, and the stream's unigram entropy."""

from __future__ import annotations

import numpy as np


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


def bigram_entropy(tokens: np.ndarray) -> float:
  """Conditional entropy (nats) of a token given the one before it, from the stream's own pair
  counts: the loss of the best model that sees only the current token (in memory; for the
  CPU corpora)."""
  tokens = np.asarray(tokens).reshape(-1).astype(np.int64)
  if tokens.size < 2:
    raise ValueError('bigram_entropy needs at least two tokens.')
  pairs = tokens[:-1] * (int(tokens.max()) + 1) + tokens[1:]
  _, pair_counts = np.unique(pairs, return_counts=True)
  _, first_counts = np.unique(tokens[:-1], return_counts=True)
  h = lambda c: float(-(c / c.sum() * np.log(c / c.sum())).sum())
  return h(pair_counts) - h(first_counts)   # H(prev, next) - H(prev)
