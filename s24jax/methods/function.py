"""A method from a plain projection function w -> w_tilde (registry.register_projection)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from s24jax.methods import base


@dataclasses.dataclass(frozen=True)
class FunctionProjection(base.Method):
  """Stateless; its mask is the support of its output, its flip rate measured every step like
  any 2:4 method's."""
  fn: Callable[[jax.Array], jax.Array] | None = dataclasses.field(default=None,
                                                                  metadata=base.INTERNAL)

  def project(self, kernel, layer):
    del layer
    return self.fn(kernel)

  def mask(self, kernel, layer):
    del layer
    return self.fn(jax.lax.stop_gradient(kernel)) != 0
