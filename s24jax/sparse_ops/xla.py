"""The 'xla' backend: the reference every other backend is tested against.

The three GEMMs as plain XLA matmuls on the (masked) W~: mathematically the sparse product,
no speed-up. It takes any W~, 2:4 or not (MST's unstructured masks run here).
"""
from __future__ import annotations

import functools

import jax

from s24jax.sparse_ops import common
from s24jax.sparse_ops.backend import Backend
from s24jax.sparse_ops.options import GemmOptions


# opts (argument 0) is static configuration, not an array.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def linear_2d(opts: GemmOptions, x: jax.Array, w: jax.Array,
              key: jax.Array | None) -> jax.Array:
  return common.fwd_gemm(x, w.astype(x.dtype), opts).astype(x.dtype)     # (N, out)


def _fwd(opts, x, w, key):
  return linear_2d(opts, x, w, key), (x, w, key)


def _bwd(opts, res, dy):
  x, w, key = res
  dx = common.dgrad_gemm(dy, w.astype(dy.dtype), opts).astype(x.dtype)        # (N, in)
  dw = common.wgrad_gemm(dy, x.astype(dy.dtype), key, opts).astype(w.dtype)   # (out, in)
  return dx, dw, common.key_cotangent(key)


linear_2d.defvjp(_fwd, _bwd)


def linear(opts, x, w, key, prepared):
  del prepared
  return linear_2d(opts, x, w, key)


BACKEND = Backend(linear=linear, needs_24=False)
