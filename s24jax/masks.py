"""Pure N:M sparsity math: masks, flip rate. No autodiff rules live here.

Convention (DESIGN.md section 4): W is [out, in]; y = x W^T contracts over `in`, so the
groups of M consecutive entries run along the *last* axis.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_groupable(x: jax.Array, m: int, what: str = "last axis") -> None:
  if x.ndim < 1 or x.shape[-1] % m:
    raise ValueError(
        f"N:M sparsity needs the {what} to be a multiple of {m}; got shape {tuple(x.shape)} "
        f"(dimension {x.shape[-1] if x.ndim else None} is not divisible by {m}).")


def nm_mask(w: jax.Array, n: int = 2, m: int = 4) -> jax.Array:
  """Bool mask keeping the n largest |w| in every group of m along the last axis.

  Ties go to the lower index (a stable ranking), so exactly n entries are kept per group.
  """
  _check_groupable(w, m)
  g = jnp.abs(w).reshape(*w.shape[:-1], w.shape[-1] // m, m)   # (..., K/m, m)
  # rank[i] = number of entries that beat entry i: larger, or equal with a lower index.
  a = g[..., :, None]                                             # (..., K/m, m, 1) entry i
  b = g[..., None, :]                                             # (..., K/m, 1, m) entry j
  idx = jnp.arange(m)
  lower = idx[None, :] < idx[:, None]                             # j < i
  beats = (b > a) | ((b == a) & lower)
  rank = beats.sum(-1)                                            # (..., K/m, m)
  return (rank < n).reshape(w.shape)


def flip_rate(mask_new: jax.Array, mask_old: jax.Array) -> jax.Array:
  """Fraction of entries whose mask bit changed between two steps (DESIGN.md: r_t)."""
  return jnp.mean((mask_new != mask_old).astype(jnp.float32))
