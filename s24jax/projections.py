"""Projections W -> W~ by name: the public names over the method registry.

Every sparse-training method (s24jax/methods/) is selected by `config.sparsity.method`;
its `project(kernel, layer)` is the custom_vjp projection. This module keeps the one-line path
for a plain projection function, which becomes a method:

    @jax.custom_vjp
    def my24(w): ...
    projections.register_projection("my24", my24)   # then config.sparsity.method = "my24"

and the S-STE functions under their public names.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from s24jax.methods import base
from s24jax.methods.s_ste import s_ste_scale, soft_threshold24  # noqa: F401  (public names)
from s24jax.methods.ste import ste24  # noqa: F401

get_projection = base.get_method
available_projections = base.available_methods


@dataclasses.dataclass(frozen=True)
class FunctionProjection(base.Method):
  """A method from a plain function w -> w_tilde: stateless, its mask the support of its
  output, flip rate measured every step like any 2:4 method."""
  fn: Callable[[jax.Array], jax.Array] | None = dataclasses.field(default=None,
                                                                  metadata=base.INTERNAL)

  def project(self, kernel, layer):
    del layer
    return self.fn(kernel)

  def mask(self, kernel, layer):
    del layer
    return self.fn(jax.lax.stop_gradient(kernel)) != 0


def register_projection(name: str, fn: base.Method | Callable[[jax.Array], jax.Array], *,
                        overwrite: bool = False) -> base.Method:
  """Registers `fn` under `name`: a `Method`, or a plain function w -> w_tilde (usually a
  jax.custom_vjp) that becomes a `FunctionProjection`."""
  if isinstance(fn, base.Method):
    return base.register_method(name, fn, overwrite=overwrite)
  if not callable(fn):
    raise TypeError(f"register_projection needs a Method or a callable, got {fn!r}")
  return base.register_method(name, FunctionProjection(fn=fn), overwrite=overwrite)
