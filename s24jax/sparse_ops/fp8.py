"""FP8 quantization with per-tensor amax scaling, and FP8 GEMMs with float32 accumulation.

The S-STE recipe (Hu, Zhu, Chen 2024) runs the FFN GEMMs in FP8, the Transformer-Engine way:
forward operands (activations x, weights W) in e4m3 (3 mantissa bits, max 448), gradients
dY in e5m2 (2 mantissa bits, max 57344: more range, less precision) in both backward GEMMs.

Per-tensor scaling: scale = fmax / amax(|x|), q = saturate(x * scale) cast to the float8
dtype (round to nearest even), x ~ q / scale. The amax is the *current* tensor's (one extra
reduction per operand); Transformer Engine's "delayed scaling" takes it from a history of
past steps to save that pass. Current-step amax is simpler, stateless (nothing to
checkpoint) and never overflows; delayed scaling is not implemented.

The GEMM pattern (`fp8_dot_general`):

    qa, sa = quantize(a, e4m3); qb, sb = quantize(b, e5m2)
    y = lax.dot_general(qa, qb, dims, preferred_element_type=float32) * ((1/sa) * (1/sb))

On Ada/Hopper (sm_89+, CUDA 12+) XLA's GEMM rewriter turns a dot with float8 operands and a
float32 result, times a scalar, into one cuBLASLt FP8 GEMM (`__cublas$lt$matmul$f8`) with
fp32 accumulation and the scalar folded in (see XLA's gemm_rewriter_fp8_test.cc); cuBLASLt
needs one e4m3 operand, so e4m3 x e4m3 and e5m2 x e4m3 qualify (e5m2 x e5m2 does not: only
sparsity.fp8_backward_operands='e5m2' uses it, and `scaled_dot_general` runs that one as the
exact bf16 GEMM of the same values). On older GPUs XLA upcasts the operands and runs an
ordinary GEMM.
On CPU, XLA upcasts the float8 operands to float32 and runs an fp32 GEMM. The product of two
float8 numbers is exact in float32, so the CPU result is the quantize-dequantize simulation
with the very same rounding of the operands: numerically faithful, only the order of fp32
additions differs. (Not yet checked on a GPU here: look for `__cublas$lt$matmul$f8` in
`jax.jit(f).lower(...).compile().as_text()` on an H100.)

`s24jax.sparse_ops` uses these helpers for its three GEMMs when `sparsity.fp8` is on:
y = x W~^T (e4m3 x e4m3), dX = dY W~ (e5m2 x e4m3), dW = est(dY^T) x (e5m2 x e4m3). Quantizing
is deterministic, so the backward GEMMs see exactly the x and W~ operands the forward saw.
With sparsity.fp8_backward_operands='e5m2' (the S-STE reference code) the backward GEMMs
re-quantize W~ and x to e5m2 instead: e5m2 x e5m2.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from s24jax.kernels import _common

E4M3 = jnp.float8_e4m3fn    # forward operands: activations and weights
E5M2 = jnp.float8_e5m2      # gradients (dY) in both backward GEMMs
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def _check_format(dtype) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(E4M3), jnp.dtype(E5M2)):
    raise ValueError(f"unsupported float8 format {dtype}; valid: float8_e4m3fn (e4m3), "
                     "float8_e5m2 (e5m2)")
  return dtype


def fmax(dtype) -> float:
  """The largest finite value of a float8 format (448 for e4m3fn, 57344 for e5m2)."""
  return float(jnp.finfo(_check_format(dtype)).max)


def amax_scale(x: jax.Array, dtype) -> jax.Array:
  """The per-tensor scale fmax / amax(|x|) (float32 scalar) mapping amax to the max finite value.

  An all-zero tensor gets scale 1 (nothing to scale). The scale is capped at the largest
  float32 so that a tensor of denormals does not produce an infinite scale.
  """
  return scale_from_amax(jnp.max(jnp.abs(x)).astype(jnp.float32), dtype)


def scale_from_amax(amax: jax.Array, dtype) -> jax.Array:
  """`amax_scale` from a given amax (e.g. the max over the shards of a sharded tensor)."""
  scale = fmax(dtype) / jnp.where(amax > 0, amax, 1.0)
  return jnp.where(amax > 0, jnp.minimum(scale, jnp.finfo(jnp.float32).max), 1.0)


@jax.named_scope("fp8_quantize")   # its kernels, by name in the compiled HLO (step_census)
def quantize(x: jax.Array, dtype, scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(q, scale): q = x * scale saturated to +-fmax and cast (round to nearest even) to `dtype`.

  `scale` defaults to the current amax scale, `amax_scale(x, dtype)`. Saturating matters:
  a plain cast of an out-of-range value gives NaN in e4m3fn (it has no infinity).
  """
  dtype = _check_format(dtype)
  if scale is None:
    scale = amax_scale(x, dtype)
  m = fmax(dtype)
  q = jnp.clip(x.astype(jnp.float32) * scale, -m, m).astype(dtype)
  return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """q / scale in `dtype` (the inverse of `quantize` up to its rounding)."""
  return (q.astype(jnp.float32) / scale).astype(dtype)


def scaled_dot_general(qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array,
                       dimension_numbers: DimensionNumbers, out_dtype) -> jax.Array:
  """dot_general of already-quantized operands, fp32 accumulation, then unscaled.

  One scalar multiply of the fp32 product: XLA's GPU GEMM rewriter folds exactly this
  `dot(f8, f8) * broadcast(scalar)` into the cuBLASLt FP8 call's scale. (1/sa) * (1/sb)
  rather than 1 / (sa * sb): sa * sb can overflow float32 for tiny tensors.
  """
  dq_scale = (1.0 / sa) * (1.0 / sb)
  if qa.dtype == qb.dtype == E5M2:
    # No FP8 GEMM takes e5m2 x e5m2 (cuBLASLt wants one e4m3 operand): XLA's own fallback
    # ran 2.6x slower than a bf16 GEMM on an H200 (2026-11-27: 1.165 against 0.453 ms for
    # dW of the 124M fc, 65536 tokens). e5m2 is a subset of bfloat16 (more exponent and
    # mantissa bits), so on a GPU the bf16 GEMM multiplies the very same values, products
    # exact in its float32 accumulation. Elsewhere float32, as XLA:CPU upcasts float8 (its
    # dot has no bf16 x bf16 = f32 kernel).
    wide = jnp.bfloat16 if _common.target_device().platform == "gpu" else jnp.float32
    qa, qb = qa.astype(wide), qb.astype(wide)
  y = jax.lax.dot_general(qa, qb, dimension_numbers,
                          preferred_element_type=jnp.float32)
  return (y * dq_scale).astype(out_dtype)


def fp8_dot_general(a: jax.Array, b: jax.Array, dimension_numbers: DimensionNumbers, *,
                    a_dtype=E4M3, b_dtype=E4M3, out_dtype=None) -> jax.Array:
  """lax.dot_general(a, b) with both operands quantized to float8 (per-tensor amax scales).

  Accumulates in float32; the result is in `out_dtype` (default: a's dtype).
  """
  qa, sa = quantize(a, a_dtype)
  qb, sb = quantize(b, b_dtype)
  return scaled_dot_general(qa, sa, qb, sb, dimension_numbers, out_dtype or a.dtype)


def fp8_dot(a: jax.Array, b: jax.Array, *, a_dtype=E4M3, b_dtype=E4M3,
            out_dtype=None) -> jax.Array:
  """a @ b in FP8 for a (..., K) and b (K, N): contracts a's last axis with b's first."""
  if a.shape[-1] != b.shape[0]:
    raise ValueError(f"fp8_dot: contraction sizes differ: a {a.shape} (last axis) vs "
                     f"b {b.shape} (first axis)")
  dims = (((a.ndim - 1,), (0,)), ((), ()))
  return fp8_dot_general(a, b, dims, a_dtype=a_dtype, b_dtype=b_dtype, out_dtype=out_dtype)
