"""ste: hard-threshold 2:4 with the straight-through estimator (docs/algorithms.md, STE)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from s24jax.kernels import masks
from s24jax.methods import base


@jax.custom_vjp
def ste24(w: jax.Array) -> jax.Array:
  """Forward W~ = m(W) * W, m keeps the two largest |w| of every 4 along the last axis.
  Backward: dL/dW := dL/dW~ (identity; pruned weights get the gradient too, which is what
  lets the mask change)."""
  return jnp.where(masks.nm_mask(w), w, 0)


def _ste24_fwd(w):
  return ste24(w), None


def _ste24_bwd(_, g):
  return (g,)


ste24.defvjp(_ste24_fwd, _ste24_bwd)


@dataclasses.dataclass(frozen=True)
class STE(base.Method):

  def project(self, kernel, layer):
    del layer
    return ste24(kernel)
