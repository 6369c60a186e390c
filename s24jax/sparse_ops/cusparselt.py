"""The 'cusparselt' backend: cuSPARSELt's 2:4 GEMMs through the XLA FFI (A100, H100 and newer).

With x (T, K) tokens, W~ (N, K) 2:4 along K, dY (T, N), every GEMM in a layout and with types
the library plans (kernels/cusparselt/rules.py; each GEMM is checked against those rules at
trace time):

  forward        y^T (N, T) = W~ x^T             A = W~, compressed once per step (`prepare`)
  data gradient  dX^T (K, T) = W~^T dY^T          transposable masks only (W~^T is 2:4 along N);
                                                  A = W~^T, compressed once per step; dense
                                                  XLA otherwise
  weight grad.   dW (N, K) = MVUE(dY^T) x          with sparsity.mvue (A = the estimate, 2:4
                                                  along T, compressed per micro-batch); dense
                                                  XLA otherwise

Layouts. 16-bit operands take every layout, so none is copied: dX is the NN GEMM on W~ itself
and dW the TT GEMM on x itself. 8-bit (FP8) operands take only TN (R3), so W~^T is materialized
for dX (once per step, in `prepare`) and x^T for dW (per micro-batch). D is written in the
order the next op reads it (y and dX as the column-major D^T, dW row-major): no transposes.

Types. bf16 operands write bf16 (R2: there is no bf16-in, f32-out kernel), so each
micro-batch's dW is rounded to bf16 before the accumulation adds it in float32, where the 'xla'
backend keeps it in float32 (docs/backends.md gives the measured difference). FP8 (sparsity.fp8)
takes one FP8 type per GEMM (R1): the forward is e4m3 x e4m3, the backward GEMMs take dY and
W~ / x both in sparsity.fp8_backward_operands, which must be 'e5m2' here ('auto' picks it:
the S-STE reference's e5m2 backward, the same formats as the 'xla' backend's 'e5m2'); FP8
GEMMs write float32, with the per-tensor scales of 'xla' applied after. float32 operands are
refused (R7: 50% sparsity is 1:2 for float32). FP8 needs compute capability 8.9 (L4, L40S,
H100 and newer), 16-bit 8.0 (R8).

Under a mesh each device runs its own shard (`per_device`). Compiled for A100 and H100
without a GPU; its CPU tests use the jnp stand-in of kernels/cusparselt/ops.py, which
enforces the same rules. It has never run on a GPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from s24jax import fp8 as fp8_lib
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.kernels.cusparselt import rules
from s24jax.sparse_ops import backend as backend_lib
from s24jax.sparse_ops import common
from s24jax.sparse_ops.options import GemmOptions

# The FP8 format of both operands of the backward GEMMs that 'auto' picks here (R1: one type
# per GEMM; dY wants e5m2's range).
FP8_BACKWARD = "e5m2"


def check(opts: GemmOptions) -> None:
  if opts.fp8 and opts.fp8_backward_operands != FP8_BACKWARD:
    raise ValueError(
        f"sparsity.backend='cusparselt' with sparsity.fp8 needs "
        f"sparsity.fp8_backward_operands='{FP8_BACKWARD}' (or 'auto', which picks it), not "
        f"{opts.fp8_backward_operands!r}: cuSPARSELt takes one FP8 type per GEMM "
        "(kernels/cusparselt/rules.py, R1), and the data and weight gradients' dY is e5m2, so "
        "W~ and x join it in e5m2 (as the S-STE reference does). 'e4m3' (W~ and x in e4m3, "
        "dY in e5m2) runs on sparsity.backend='xla'.")


def formats(opts: GemmOptions):
  """(forward format, backward format): the FP8 dtypes of the GEMMs' operands, or
  (None, None) without FP8 (the operands stay in the compute dtype)."""
  if not opts.fp8:
    return None, None
  return fp8_lib.E4M3, common.backward_format(opts)


def _k_major_only(dtype) -> bool:
  """Whether cuSPARSELt takes operands of `dtype` in the TN layout only (rules R3)."""
  return rules.rule(cusparselt.dtype_name(dtype)).k_major_only


def fwd_gemm(t: int, n: int, k: int) -> cusparselt.Gemm:
  """y^T (N, T) = W~ (N x K, 2:4 along K) x^T: TN, A = W~ (N, K), B = x (T, K)."""
  return cusparselt.Gemm(m=n, n=t, k=k, trans_a=True, trans_b=False)


def dgrad_gemm(t: int, n: int, k: int, tn: bool) -> cusparselt.Gemm:
  """dX^T (K, T) = W~^T (K x N, 2:4 along N) dY^T, B = dY (T, N). TN: A = W~^T (K, N)
  materialized; NN: A = W~ (N, K) itself."""
  return cusparselt.Gemm(m=k, n=t, k=n, trans_a=tn, trans_b=False)


def wgrad_gemm(t: int, n: int, k: int, tn: bool) -> cusparselt.Gemm:
  """dW (N, K), row-major D, = MVUE(dY^T) (N x T, 2:4 along T) x, A = the estimate (N, T).
  TN: B = x^T (K, T) materialized; TT: B = x (T, K) itself."""
  return cusparselt.Gemm(m=n, n=k, k=t, trans_a=True, trans_b=not tn, d_row_major=True)


def quantize(a: jax.Array, fmt, opts: GemmOptions):
  """(a in `fmt` with its per-tensor scale (the whole tensor's under shard_map), scale); a
  itself and None without FP8."""
  if fmt is None:
    return a, None
  return fp8_lib.quantize(a, fmt, common.fp8_scale(a, fmt, opts))


def out_dtype(fmt, compute_dtype):
  return jnp.float32 if fmt is not None else compute_dtype


def compressed_gemm(compressed: jax.Array, a_dtype, a_scale, b: jax.Array,
                    gemm: cusparselt.Gemm, opts: GemmOptions, fmt) -> jax.Array:
  """The D array (gemm.d_shape()) float32 of an A compressed beforehand times the B array
  (quantized here in `fmt` under FP8, both scales applied to the float32 result)."""
  qb, sb = quantize(b, fmt, opts)
  d = cusparselt.spmm(compressed, qb, gemm, a_dtype=a_dtype,
                      out_dtype=out_dtype(fmt, b.dtype)).astype(jnp.float32)
  return d if fmt is None else d * ((1.0 / a_scale) * (1.0 / sb))


def sparse_gemm(a: jax.Array, b: jax.Array, gemm: cusparselt.Gemm, opts: GemmOptions,
                fmt) -> jax.Array:
  """`compressed_gemm` with A compressed here (quantized first under FP8)."""
  qa, sa = quantize(a, fmt, opts)
  compressed = cusparselt.compress(qa, gemm, b_dtype=qa.dtype,
                                   d_dtype=out_dtype(fmt, b.dtype))
  return compressed_gemm(compressed, qa.dtype, sa, b, gemm, opts, fmt)


def prepare(w: jax.Array, *, tokens: int, dtype, opts: GemmOptions) -> dict[str, jax.Array]:
  """W~ (N, K) compressed for the forward ('fwd') and, for transposable masks, the
  data-gradient GEMM ('dx') of a micro-batch of `tokens` tokens per device, in `dtype` (FP8:
  the forward's e4m3 and the backward's format, with their scales 'fwd_scale', 'dx_scale').
  The train step computes these once per optimizer step, outside the accumulation loop, so
  that no micro-batch and no recomputed forward compresses W~ again."""
  n, k = w.shape
  w = jax.lax.stop_gradient(w).astype(dtype)
  fwd_fmt, bwd_fmt = formats(opts)
  prepared = {}
  # W~ is replicated (the FSDP all-gather): its own amax is the global one.
  qw, sw = (w, None) if fwd_fmt is None else fp8_lib.quantize(w, fwd_fmt)
  prepared["fwd"] = cusparselt.compress(qw, fwd_gemm(tokens, n, k), b_dtype=qw.dtype,
                                        d_dtype=out_dtype(fwd_fmt, dtype))
  if sw is not None:
    prepared["fwd_scale"] = sw
  if opts.transposable:
    qd, sd = (w, None) if bwd_fmt is None else fp8_lib.quantize(w, bwd_fmt)
    tn = _k_major_only(qd.dtype)
    prepared["dx"] = cusparselt.compress(qd.T if tn else qd, dgrad_gemm(tokens, n, k, tn),
                                         b_dtype=qd.dtype, d_dtype=out_dtype(bwd_fmt, dtype))
    if sd is not None:
      prepared["dx_scale"] = sd
  return prepared


def _a_dtype(fmt, x: jax.Array):
  """The dtype an A operand was compressed in: the GEMM's FP8 format, else x's dtype."""
  return x.dtype if fmt is None else fmt


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def linear_2d(opts: GemmOptions, x: jax.Array, w: jax.Array, key: jax.Array | None,
              prepared: dict) -> jax.Array:
  t, k = x.shape
  n = w.shape[0]
  fmt, _ = formats(opts)
  if "fwd" in prepared:
    y = compressed_gemm(prepared["fwd"], _a_dtype(fmt, x), prepared.get("fwd_scale"), x,
                        fwd_gemm(t, n, k), opts, fmt)                    # (T, N)
  else:
    y = sparse_gemm(w.astype(x.dtype), x, fwd_gemm(t, n, k), opts, fmt)  # (T, N)
  return y.astype(x.dtype)


def _fwd(opts, x, w, key, prepared):
  # W~ itself is needed in the backward only where a GEMM compresses it there or is dense.
  # (Otherwise a zero-size stand-in of W~'s row count and dtype.)
  keep_w = not (opts.transposable and "dx" in prepared)
  w_res = w if keep_w else jnp.zeros((w.shape[0], 0), w.dtype)
  return linear_2d(opts, x, w, key, prepared), (x, w_res, key, prepared)


def _bwd(opts, res, dy):
  x, w, key, prepared = res
  (t, k), n = x.shape, w.shape[0]
  _, fmt = formats(opts)
  dy = dy.astype(x.dtype)
  if opts.transposable:
    tn = _k_major_only(_a_dtype(fmt, x))
    gemm = dgrad_gemm(t, n, k, tn)
    if "dx" in prepared:
      dx = compressed_gemm(prepared["dx"], _a_dtype(fmt, x), prepared.get("dx_scale"), dy,
                           gemm, opts, fmt)                                # (T, K)
    else:
      wd = w.astype(x.dtype)
      dx = sparse_gemm(wd.T if tn else wd, dy, gemm, opts, fmt)            # (T, K)
  else:
    dx = common.dgrad_gemm(dy, w.astype(dy.dtype), opts)                   # (T, K), dense
  if opts.mvue:   # the point of MVUE: dW = MVUE(dY^T) x, 2:4 along the tokens
    est = common.wgrad_operand(dy, key, opts)                              # (N, T)
    tn = _k_major_only(_a_dtype(fmt, x))
    dw = sparse_gemm(est, x.T if tn else x, wgrad_gemm(t, n, k, tn), opts,
                     fmt)                                                  # (N, K)
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


BACKEND = backend_lib.Backend(linear=linear, prepare=prepare, check=check,
                              fp8_backward=FP8_BACKWARD)
