"""The language-modelling loss."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Sum over tokens of -log p(target); logits (B, T, V) float32, targets (B, T)."""
  logz = jax.nn.logsumexp(logits, axis=-1)                                   # (B, T)
  tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]     # (B, T)
  return jnp.sum(logz - tgt)
