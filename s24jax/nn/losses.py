"""The language-modelling loss: plain, or chunked so the f32 logits never exist whole."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def cross_entropy_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Sum over tokens of -log p(target); logits (B, T, V) float32, targets (B, T)."""
  logz = jax.nn.logsumexp(logits, axis=-1)                                   # (B, T)
  tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]     # (B, T)
  return jnp.sum(logz - tgt)


def chunked_cross_entropy_sum(x: jax.Array, targets: jax.Array,
                              head: Callable[..., jax.Array], chunk: int) -> jax.Array:
  """cross_entropy_sum(head(x), targets) without materialising the (B, T, V) logits.

  x (B, T, C) are the final hidden states, head(x_chunk, chunk_index) -> logits (n, V) the
  output layer as a pure function. The B*T tokens are processed `chunk` at a time in a
  lax.scan whose body is rematerialised (jax.checkpoint): the forward keeps one chunk's
  logits alive, and the backward recomputes each chunk's logits instead of storing them, so
  the loss costs O(chunk * V) memory instead of O(B * T * V), for one extra head matmul.
  Equal to the plain loss up to float summation order.
  """
  b, t, c = x.shape
  n = b * t
  pad = -n % chunk
  xs = jnp.pad(x.reshape(n, c), ((0, pad), (0, 0))).reshape(-1, chunk, c)   # (n/chunk, chunk, C)
  ts = jnp.pad(targets.reshape(n), (0, pad)).reshape(-1, chunk)              # (n/chunk, chunk)
  valid = (jnp.arange(n + pad) < n).reshape(-1, chunk)                       # (n/chunk, chunk)

  @jax.checkpoint
  def one(xc, tc, vc, i):
    logits = head(xc, i).astype(jnp.float32)                                 # (chunk, V)
    logz = jax.nn.logsumexp(logits, axis=-1)                                 # (chunk,)
    tgt = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]            # (chunk,)
    return jnp.sum(jnp.where(vc, logz - tgt, 0.0))

  def body(total, xs_i):
    return total + one(*xs_i), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (xs, ts, valid, jnp.arange(xs.shape[0])))
  return total
