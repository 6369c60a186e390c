"""The 'cusparselt' backend: cuSPARSELt's 2:4 GEMMs through the XLA FFI (A100, H100 and newer).

  forward        y^T (N, T) = W~ x^T            W~ compressed (prepared once per step)
  data gradient  dX^T (K, T) = W~^T dY^T         transposable masks only; dense otherwise
  weight grad.   dW (N, K) = MVUE(dY^T) x        with sparsity.mvue; dense otherwise

FP8 (e4m3 / e5m2, per-tensor scales as in 'xla') with sparsity.fp8; not with
sparsity.fp8_backward_operands='e5m2'. The GEMM convention is kernels/cusparselt/ops.py's:
x (T, K), W~ (N, K), dY (T, N), all row-major, passed as they are. Under a mesh each device
runs its own shard (`per_device`). Compiled for A100 and H100 without a GPU; its CPU tests use
the jnp stand-in of kernels/cusparselt/ops.py, and it has never run on a GPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from s24jax import fp8 as fp8_lib
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.sparse_ops import backend as backend_lib
from s24jax.sparse_ops import common
from s24jax.sparse_ops.options import GemmOptions


def check(opts: GemmOptions) -> None:
  if opts.fp8 and opts.fp8_backward_operands != "e4m3":
    raise ValueError(f"sparsity.fp8_backward_operands={opts.fp8_backward_operands!r} is not "
                     "supported by sparsity.backend='cusparselt': dY, W~ and x would all be "
                     "e5m2, and an FP8 tensor-core GEMM (cuSPARSELt's, on Hopper) needs one "
                     "e4m3 operand; e5m2 x e5m2 has none. Use 'e4m3' with 'cusparselt', or "
                     "sparsity.backend='xla'.")


def _fwd_gemm(t: int, n: int, k: int) -> cusparselt.Gemm:
  """y^T (N, T) = W~ (N x K, 2:4 along K) x^T: the A array is W~ itself, B is x."""
  return cusparselt.Gemm(m=n, n=t, k=k, trans_a=True, trans_b=False)


def _dgrad_gemm(t: int, n: int, k: int) -> cusparselt.Gemm:
  """dX^T (K, T) = W~^T (K x N, 2:4 along N: transposable) dY^T: A is W~, B is dY."""
  return cusparselt.Gemm(m=k, n=t, k=n, trans_a=False, trans_b=False)


def _wgrad_gemm(t: int, n: int, k: int) -> cusparselt.Gemm:
  """dW (N, K) = MVUE(dY^T) (N x T, 2:4 along T) x: A is MVUE(dY^T), B is x; D is dW^T."""
  return cusparselt.Gemm(m=n, n=k, k=t, trans_a=True, trans_b=True)


def _gemm(a: jax.Array, b: jax.Array, gemm: cusparselt.Gemm, opts: GemmOptions,
          a_format=fp8_lib.E4M3, b_format=fp8_lib.E4M3) -> jax.Array:
  """D array (gemm.d_shape()) float32 of the sparse A array times the B array: A compressed
  here (FP8: quantized first), then `_prepared_gemm`."""
  if opts.fp8:
    qa, sa = fp8_lib.quantize(a, a_format, common.fp8_scale(a, a_format, opts))
  else:
    qa, sa = a, None
  b_dtype = b_format if opts.fp8 else b.dtype
  out = jnp.float32 if opts.fp8 else b.dtype
  compressed = cusparselt.compress(qa, gemm, b_dtype=b_dtype, d_dtype=out)
  return _prepared_gemm(compressed, qa.dtype, sa, b, gemm, opts, b_format)


def _prepared_gemm(compressed: jax.Array, a_dtype, a_scale, b: jax.Array,
                   gemm: cusparselt.Gemm, opts: GemmOptions, b_format) -> jax.Array:
  """`_gemm` with A compressed beforehand (`prepare`): only B is quantized."""
  if opts.fp8:
    qb, sb = fp8_lib.quantize(b, b_format, common.fp8_scale(b, b_format, opts))
    dq = (1.0 / a_scale) * (1.0 / sb)
  else:
    qb, dq = b, None
  out = jnp.float32 if opts.fp8 else b.dtype
  d = cusparselt.spmm(compressed, qb, gemm, a_dtype=a_dtype,
                      out_dtype=out).astype(jnp.float32)
  return d if dq is None else d * dq


def prepare(w: jax.Array, *, tokens: int, dtype, opts: GemmOptions) -> dict[str, jax.Array]:
  """W~ (N, K) compressed for the forward and (transposable) the data-gradient GEMM of a
  micro-batch of `tokens` tokens per device, in `dtype` (FP8: e4m3 with W~'s amax scale,
  'w_scale'). The train step computes these once per optimizer step, outside the
  accumulation loop, so that no micro-batch and no recomputed forward compresses W~ again."""
  n, k = w.shape
  w = jax.lax.stop_gradient(w).astype(dtype)
  out_dtype = jnp.float32 if opts.fp8 else jnp.dtype(dtype)
  if opts.fp8:
    qw, sw = fp8_lib.quantize(w, fp8_lib.E4M3)   # W~ is replicated: its own amax is global
  else:
    qw, sw = w, None
  x_dtype = fp8_lib.E4M3 if opts.fp8 else dtype
  prepared = {"fwd": cusparselt.compress(qw, _fwd_gemm(tokens, n, k), b_dtype=x_dtype,
                                         d_dtype=out_dtype)}
  if opts.transposable:
    dy_dtype = fp8_lib.E5M2 if opts.fp8 else dtype
    prepared["dx"] = cusparselt.compress(qw, _dgrad_gemm(tokens, n, k), b_dtype=dy_dtype,
                                         d_dtype=out_dtype)
  if sw is not None:
    prepared["w_scale"] = sw
  return prepared


def _a_dtype(x: jax.Array, opts: GemmOptions):
  """The dtype W~ was compressed in: e4m3 with FP8, else the compute dtype."""
  return fp8_lib.E4M3 if opts.fp8 else x.dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def linear_2d(opts: GemmOptions, x: jax.Array, w: jax.Array, key: jax.Array | None,
              prepared: dict) -> jax.Array:
  t, k = x.shape
  n = w.shape[0]
  if "fwd" in prepared:
    y = _prepared_gemm(prepared["fwd"], _a_dtype(x, opts), prepared.get("w_scale"), x,
                       _fwd_gemm(t, n, k), opts, fp8_lib.E4M3)            # (T, N)
  else:
    y = _gemm(w.astype(x.dtype), x, _fwd_gemm(t, n, k), opts)            # (T, N)
  return y.astype(x.dtype)


def _fwd(opts, x, w, key, prepared):
  return linear_2d(opts, x, w, key, prepared), (x, w, key, prepared)


def _bwd(opts, res, dy):
  x, w, key, prepared = res
  (t, k), n = x.shape, w.shape[0]
  dy = dy.astype(x.dtype)
  if opts.transposable and "dx" in prepared:
    dx = _prepared_gemm(prepared["dx"], _a_dtype(x, opts), prepared.get("w_scale"), dy,
                        _dgrad_gemm(t, n, k), opts, fp8_lib.E5M2)            # (T, K)
  elif opts.transposable:
    dx = _gemm(w.astype(x.dtype), dy, _dgrad_gemm(t, n, k), opts,
               fp8_lib.E4M3, fp8_lib.E5M2)                                 # (T, K)
  else:
    dx = common.dgrad_gemm(dy, w.astype(dy.dtype), opts)                   # (T, K), dense
  if opts.mvue:   # the point of MVUE: dW = MVUE(dY^T) x, 2:4 along the tokens
    est = common.wgrad_operand(dy, key, opts)                              # (N, T)
    dw = _gemm(est, x, _wgrad_gemm(t, n, k), opts, fp8_lib.E5M2, fp8_lib.E4M3).T   # (N, K)
  else:
    dw = common.wgrad_gemm(dy, x, key, opts)                               # (N, K), dense
  dprepared = jax.tree.map(
      lambda p: (jnp.zeros_like(p) if jnp.issubdtype(p.dtype, jnp.floating)
                 else np.zeros(p.shape, jax.dtypes.float0)), prepared)
  return dx.astype(x.dtype), dw.astype(w.dtype), common.key_cotangent(key), dprepared


linear_2d.defvjp(_fwd, _bwd)


def per_device(op, opts: GemmOptions):
  """`op` on each device's own rows of x under the context mesh (jax.sharding.get_abstract_mesh,
  set by the train step): an opaque custom call cannot be partitioned by XLA, which would
  otherwise gather the batch-sharded activations and run the whole global GEMM everywhere.
  W~ is replicated into it (the FSDP all-gather, as for any GEMM); its gradient is summed
  over the devices by shard_map's transpose (the data-parallel all-reduce). MVUE draws from
  fold_in(key, device index), so the shards' estimates are independent; FP8 scales are the
  whole tensors' (a pmax of the shards' amax)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return functools.partial(op, opts)
  axes = tuple(mesh.axis_names)
  P = jax.sharding.PartitionSpec
  local_opts = dataclasses.replace(opts, token_axes=axes)

  def local(x, w, key, prepared):
    if key is not None and opts.mvue:
      key = jax.random.fold_in(key, jax.lax.axis_index(axes))
    return op(local_opts, x, w, key, prepared)

  def sharded(x, w, key, prepared):
    key_spec = None if key is None else P()
    prepared_spec = jax.tree.map(lambda _: P(), prepared)   # per device, as compressed
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(P(axes, None), P(), key_spec, prepared_spec),
                         out_specs=P(axes, None), check_vma=False)(x, w, key, prepared)

  return sharded


def linear(opts, x, w, key, prepared):
  return per_device(linear_2d, opts)(x, w, key, dict(prepared))


BACKEND = backend_lib.Backend(linear=linear, prepare=prepare, check=check)
