"""Attention patterns: which (query, key) pairs a causal attention layer may use.

Hybrid Sparse Attention (MST, Hu, Li, Huang; docs/algorithms.md) trains with a sparse
causal pattern during a window of training and with dense causal attention otherwise:

  causal         q >= k                                   (dense causal; every earlier token)
  strided        q >= k and (q - k) mod l == 0            (every l-th earlier token, itself incl.)
  local_strided  q >= k and ((q - k) < l or (q - k) mod l == 0)
                                                          (the last l tokens, plus the stride)

`l` is the stride (and the local window). Masks are boolean (T, T) arrays, True where the
pair is allowed, built from index arithmetic so they are cheap to recreate inside a jitted
model for any T. Every pattern keeps the diagonal, so no query row is empty (softmax over an
empty row would be NaN).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

PATTERNS = ("causal", "strided", "local_strided")


def check_pattern(pattern: str, stride: int = 1) -> None:
  """Raises a ValueError naming the valid patterns / the bad stride."""
  if pattern not in PATTERNS:
    raise ValueError(f"unknown attention pattern {pattern!r}; valid: {', '.join(PATTERNS)}")
  if pattern != "causal" and int(stride) < 1:
    raise ValueError(f"attention pattern {pattern!r} needs a stride >= 1, got {stride}")


def _allowed(pattern: str, delta, stride: int, xp):
  """The rule of `pattern` on delta = q - k (an integer array), in numpy or jnp (`xp`)."""
  causal = delta >= 0
  if pattern == "causal":
    return causal
  on_stride = xp.remainder(delta, stride) == 0
  if pattern == "strided":
    return causal & on_stride
  return causal & ((delta < stride) | on_stride)          # local_strided


def attention_mask(pattern: str, seq_len: int, stride: int) -> jnp.ndarray:
  """Boolean (T, T) mask, mask[q, k] True where query q may attend to key k."""
  check_pattern(pattern, stride)
  q = jnp.arange(seq_len)[:, None]                                         # (T, 1)
  k = jnp.arange(seq_len)[None, :]                                         # (1, T)
  return _allowed(pattern, q - k, stride, jnp)                             # (T, T)


def allowed_pairs(pattern: str, seq_len: int, stride: int) -> int:
  """Number of allowed (q, k) pairs of one sequence (a host integer, for FLOP counting)."""
  check_pattern(pattern, stride)
  q = np.arange(seq_len)[:, None]
  k = np.arange(seq_len)[None, :]
  return int(np.count_nonzero(_allowed(pattern, q - k, stride, np)))
