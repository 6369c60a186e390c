"""The sparse linear layer and the one matmul dispatch point.

Every linear layer of the model is a `SparseLinear`; whether it is 2:4 sparse is decided by
matching its module path against `SparsityConfig.sparse_layers`. The kernel is stored as
W [out, in] (DESIGN.md notation) so that the 2:4 groups run along the last axis.

`linear(x, w_tilde, backend=..., sparse=...)` is the single place where y = x W~^T is
computed. Sparse layers go through the three-GEMM op `sparse_ops.sparse_linear` (forward,
data gradient and weight gradient all 2:4 sparse, MVUE optional); its `xla` backend is the
reference and faster backends plug in there (`sparsity.backend='pallas'`: kernels/ where they
are expected to win, `'pallas_always'`: everywhere; cuSPARSELt later). Dense layers are one
XLA matmul with the autodiff backward.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from s24jax import projections
from s24jax import sparse_ops
from s24jax.config import SparsityConfig

BACKENDS = sparse_ops.BACKENDS


def linear(x: jax.Array, w: jax.Array, *, backend: str = "xla", sparse: bool = False,
           key: jax.Array | None = None, mvue: bool = False, fp8: bool = False) -> jax.Array:
  """y = x W^T for x (..., in) and W (out, in), in x's dtype with float32 accumulation.

  sparse=True: W is the 2:4 projected weight W~ and all three GEMMs go through
  `sparse_ops.sparse_linear` on `backend` (with the MVUE weight gradient if `mvue`, drawn
  with `key`; FP8 GEMMs if `fp8`). sparse=False: a dense XLA matmul whatever the backend (sparse kernels cannot
  run a dense weight).
  """
  if backend not in BACKENDS:
    raise ValueError(f"unknown sparsity.backend {backend!r}; valid: {', '.join(BACKENDS)}")
  if sparse:
    return sparse_ops.sparse_linear(x, w, key, mvue=mvue, backend=backend, fp8=fp8)
  return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype),
                    preferred_element_type=jnp.float32).astype(x.dtype)


def is_sparse_path(path: str, sparsity: SparsityConfig) -> bool:
  """Whether the linear layer at `path` ('h_0/mlp/fc') is sparse under `sparsity`."""
  if get_projection_for(sparsity).is_dense:
    return False
  return any(fnmatch.fnmatchcase(path, pat) for pat in sparsity.sparse_layers)


def get_projection_for(sparsity: SparsityConfig) -> projections.Projection:
  return projections.get_projection(sparsity.projection)


def _initial_mask(proj: projections.Projection, kernel: jax.Array, path: str) -> jax.Array:
  """proj.mask(kernel), with the layer named in a shape error (e.g. a transposable mask
  needs `out` to be a multiple of 4 as well)."""
  try:
    return proj.mask(kernel)
  except ValueError as e:
    raise ValueError(f"sparse layer {path!r} (kernel {tuple(kernel.shape)} = (out, in)): "
                     f"{e}") from None


class SparseLinear(nn.Module):
  """y = x S(W)^T + b with W (features, in); S the configured projection if sparse.

  Sparse layers keep their projection state (e.g. the S-STE scale) and the mask of the
  last step (for the flip rate) in the 'sparsity' collection, next to 'params', so it is
  sharded and checkpointed with the rest of the train state.
  """
  features: int
  sparsity: SparsityConfig
  use_bias: bool = True
  dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.normal(0.02)
  # (x, w) -> y replacing `linear` (e.g. a V:N:M sparse-activation kernel from
  # s24jax.act_sparsity.act_matmul); None: `linear` with sparsity.backend.
  matmul: Callable | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    in_features = x.shape[-1]
    kernel = self.param("kernel", self.kernel_init, (self.features, in_features))  # (out, in)
    path = "/".join(self.path)
    w = kernel
    sparse = is_sparse_path(path, self.sparsity)
    if sparse:
      if in_features % 4:
        raise ValueError(f"sparse layer {path!r}: its input dimension (in_features) is "
                         f"{in_features}, not a multiple of 4, so it cannot be 2:4 sparse "
                         "along the contraction axis.")
      proj = get_projection_for(self.sparsity)
      if self.is_initializing():
        for name, value in proj.init_state(kernel).items():
          self.variable("sparsity", name, lambda v=value: v)
        self.variable("sparsity", "mask", lambda: _initial_mask(proj, kernel, path))
      state = dict(self.variables.get("sparsity", {}))
      w = proj.apply(kernel, state, self.sparsity)
    if self.matmul is not None:
      y = self.matmul(x.astype(self.dtype), w)                           # (..., out)
    else:
      # MVUE's key: per step from train_step's rngs={'mvue': ...}, per layer by make_rng
      # (which folds in this module's path); None outside training (forward only).
      key = (self.make_rng("mvue") if sparse and self.sparsity.mvue and self.has_rng("mvue")
             else None)
      y = linear(x.astype(self.dtype), w, backend=self.sparsity.backend, sparse=sparse,
                 key=key, mvue=self.sparsity.mvue, fp8=self.sparsity.fp8)  # (..., out)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,)).astype(self.dtype)
    return y
