"""The 'tcgen05' backend: every 2:4 GEMM on Blackwell's sparse tensor cores (kernels/tcgen05.py).

  forward        y^T = W~ x^T                 W~ compressed along `in`
  data gradient  dX^T = W~^T dY^T              W~ compressed along `out`: transposable masks
                                               only; the dense XLA GEMM otherwise
  weight grad.   dW = MVUE(dY^T) x             with sparsity.mvue; the dense GEMM otherwise

Compiled for sm_100a (python -m s24jax.kernels.compile_check --gpu b200), never run: no
Blackwell GPU was available to this project. Off a Blackwell GPU it raises kernels.tcgen05's
NotBlackwellError (naming the 'xla' backend) when the step is traced. No FP8.
"""
from __future__ import annotations

import functools

import jax

from s24jax.kernels import mvue24
from s24jax.kernels import sparsify24
from s24jax.kernels import tcgen05 as kernels
from s24jax.sparse_ops import backend as backend_lib
from s24jax.sparse_ops import common
from s24jax.sparse_ops import pallas
from s24jax.sparse_ops.options import GemmOptions


def _kernels():
  kernels.check_device()
  return kernels


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def linear_2d(opts: GemmOptions, x: jax.Array, w: jax.Array,
              key: jax.Array | None) -> jax.Array:
  values, meta = pallas.compress(w, x.dtype)
  return _kernels().forward(x, values, meta)                         # (N, out)


def _fwd(opts, x, w, key):
  values, meta = pallas.compress(w, x.dtype)                         # along in
  y = _kernels().forward(x, values, meta)                            # (N, out)
  wt = (sparsify24.compress24(w.T.astype(x.dtype), interpret=False) if opts.transposable
        else w.astype(x.dtype))                                      # along out, or dense
  return y, (x, wt, key)


def _bwd(opts, res, dy):
  x, wt, key = res
  tc = _kernels()
  dy = dy.astype(x.dtype)
  if opts.transposable:
    dx = tc.data_grad(dy, *wt)                                       # (N, in)
  else:
    dx = common.dgrad_gemm(dy, wt, opts).astype(x.dtype)             # (N, in), dense
  if opts.mvue:   # the point of MVUE: dW = MVUE(dY^T) x, 2:4 along the tokens
    common.check_mvue_key(key)
    dw = tc.weight_grad(dy, x, mvue24.seed_from_key(key))            # (out, in)
  else:
    dw = common.matmul_f32(dy.T, x, ((1,), (0,)))                    # (out, in), dense
  # w's dtype: the residual wt has it when not transposable; compressed values otherwise.
  w_dtype = wt.dtype if not opts.transposable else wt[0].dtype
  return dx.astype(x.dtype), dw.astype(w_dtype), common.key_cotangent(key)


linear_2d.defvjp(_fwd, _bwd)


def linear(opts, x, w, key, prepared):
  del prepared
  return linear_2d(opts, x, w, key)


BACKEND = backend_lib.Backend(linear=linear, check=backend_lib.no_fp8("tcgen05"))
