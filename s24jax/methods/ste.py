"""ste: hard-threshold 2:4 with the straight-through estimator (docs/algorithms.md, STE)."""
from __future__ import annotations

import dataclasses

from s24jax.kernels import masks
from s24jax.methods import base
from s24jax.methods import straight_through


@dataclasses.dataclass(frozen=True)
class STE(base.Method):
  """W~ = m(W) * W, m keeping the two largest |w| of every 4 along `in`; dL/dW := dL/dW~."""

  def project(self, kernel, layer):
    del layer
    return straight_through.masked(kernel, masks.nm_mask(kernel))
