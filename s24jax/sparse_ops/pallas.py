"""The 'pallas' and 'pallas_always' backends: forward and data gradient on compress24(W~)
with the Pallas kernels of kernels/, the weight gradient the dense (MVUE) dY^T x.

`compress24` keeps the two largest |W~| per group of 4 along `in`: exactly W~'s non-zeros,
since W~ is 2:4 (every built-in 2:4 method; MST's unstructured masks are refused by
`Backend.needs_24`). The weight gradient stays the dense GEMM of `common.wgrad_gemm`: the
kernel's own dvalues exist only at kept positions, and straight-through projections need
dL/dW~ at the pruned ones too. 'pallas' runs the kernels only where
`compressed_matmul.should_use_pallas_matmul` expects them to win (a GPU, few tokens: the
memory-bound regime) and the 'xla' reference elsewhere (always, on a CPU); 'pallas_always'
runs them for every layer (equivalence tests, benchmarks). Off a GPU the kernels run in
Pallas interpret mode (slow, exact: the CPU tests exercise the same code). No FP8.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from s24jax.kernels import _common
from s24jax.kernels import compressed_matmul
from s24jax.kernels import sparsify24
from s24jax.sparse_ops import backend as backend_lib
from s24jax.sparse_ops import common
from s24jax.sparse_ops import xla
from s24jax.sparse_ops.options import GemmOptions


def compress(w: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """compress24(W~) in the compute dtype: values (out, in/2), meta (out, ceil(in/32)) uint32."""
  return sparsify24.compress24(w.astype(dtype), interpret=_common.interpret_default())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def linear_2d(opts: GemmOptions, x: jax.Array, w: jax.Array,
              key: jax.Array | None) -> jax.Array:
  values, meta = compress(w, x.dtype)
  return compressed_matmul.sparse24_matmul(x, values, meta,
                                           interpret=_common.interpret_default())  # (N, out)


def _fwd(opts, x, w, key):
  values, meta = compress(w, x.dtype)                      # (out, in/2), (out, in/32)
  y = compressed_matmul.sparse24_matmul(x, values, meta,
                                        interpret=_common.interpret_default())   # (N, out)
  # The compressed operand (~56% of W~'s bytes) is what dX needs; w itself only for its
  # dtype (a zero-size array: residuals must be arrays).
  return y, (x, values, meta, jnp.zeros((0,), w.dtype), key)


def _bwd(opts, res, dy):
  x, values, meta, w_dtype_like, key = res
  dx = compressed_matmul.sparse24_matmul_dx(
      dy.astype(values.dtype), values, meta,
      interpret=_common.interpret_default()).astype(x.dtype)            # (N, in)
  # dL/dW~ at every position, pruned ones included (what STE-style projections map to dW).
  dw = common.wgrad_gemm(dy, x.astype(dy.dtype), key, opts).astype(w_dtype_like.dtype)
  return dx, dw, common.key_cotangent(key)                              # dw: (out, in)


linear_2d.defvjp(_fwd, _bwd)


def _check_in_features(name: str, w: jax.Array) -> None:
  if w.shape[1] % 4:
    raise ValueError(f"sparse_linear: sparsity.backend={name!r} needs W~'s input "
                     f"dimension (in_features, here {w.shape[1]} of W~ {tuple(w.shape)}) "
                     "to be a multiple of 4 (2:4 groups along it).")


def linear_where_it_wins(opts, x, w, key, prepared):
  """'pallas': the kernels where they are expected to win, the 'xla' reference elsewhere."""
  if not compressed_matmul.should_use_pallas_matmul(x.shape[0], w.shape[0], w.shape[1]):
    return xla.linear(opts, x, w, key, prepared)
  _check_in_features("pallas", w)
  return linear_2d(opts, x, w, key)


def linear_always(opts, x, w, key, prepared):
  del prepared
  _check_in_features("pallas_always", w)
  return linear_2d(opts, x, w, key)


BACKEND = backend_lib.Backend(linear=linear_where_it_wins, check=backend_lib.no_fp8("pallas"))
ALWAYS = backend_lib.Backend(linear=linear_always, check=backend_lib.no_fp8("pallas_always"))
