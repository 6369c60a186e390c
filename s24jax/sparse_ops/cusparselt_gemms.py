"""The 'cusparselt' backend's GEMMs as the library runs them: the three GEMMs of a sparse layer
(their cuSPARSELt `Gemm`: shapes, layouts, the order of D), their FP8 formats and quantization,
and the GEMM on a compressed operand (s24jax/sparse_ops/cusparselt.py: the op around them;
cusparselt.py's docstring gives the layouts and types and why).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from s24jax.sparse_ops import fp8 as fp8_lib
from s24jax.kernels.cusparselt import algorithms
from s24jax.kernels.cusparselt import compression
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.kernels.cusparselt import rules
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


def k_major_only(dtype) -> bool:
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
                    gemm: cusparselt.Gemm, opts: GemmOptions, fmt,
                    alg: algorithms.Algorithm | None = None) -> jax.Array:
  """The D array (gemm.d_shape()) float32 of an A compressed beforehand times the B array
  (quantized here in `fmt` under FP8, both scales applied to the float32 result), under the
  library's algorithm `alg` (None: its default selection)."""
  qb, sb = quantize(b, fmt, opts)
  d = cusparselt.spmm(compressed, qb, gemm, a_dtype=a_dtype,
                      out_dtype=out_dtype(fmt, b.dtype), alg=alg).astype(jnp.float32)
  return d if fmt is None else d * ((1.0 / a_scale) * (1.0 / sb))


def sparse_gemm(a: jax.Array, b: jax.Array, gemm: cusparselt.Gemm, opts: GemmOptions,
                fmt, alg: algorithms.Algorithm | None = None) -> jax.Array:
  """`compressed_gemm` with A compressed here (quantized first under FP8)."""
  qa, sa = quantize(a, fmt, opts)
  compressed = compression.compress(qa, gemm, b_dtype=qa.dtype,
                                    d_dtype=out_dtype(fmt, b.dtype))
  return compressed_gemm(compressed, qa.dtype, sa, b, gemm, opts, fmt, alg)


def operand_types(kind: str, opts: GemmOptions, dtype):
  """(FP8 format or None, the sparse operand's dtype, D's dtype) of the GEMM `kind` in the
  compute dtype `dtype`."""
  fwd_fmt, bwd_fmt = formats(opts)
  fmt = fwd_fmt if kind == "forward" else bwd_fmt
  return fmt, dtype if fmt is None else fmt, out_dtype(fmt, dtype)


def dgrad_tn(t: int, n: int, k: int, a_dtype) -> bool:
  """Whether dX's GEMM takes W~^T (K, N) as its A (TN) rather than W~ itself (NN): for 8-bit
  types (R3), and wherever s24jax compresses W~^T (its layouts are TN only; it writes W~^T
  from W~ in the same pass, kernels/cusparselt/compression.py)."""
  return k_major_only(a_dtype) or compression.s24jax_layout(
      dgrad_gemm(t, n, k, True), a_dtype) is not None
