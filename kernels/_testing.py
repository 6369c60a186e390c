"""Test helpers shared by tests/test_kernels_*.py (imports pytest; not used
by the kernels themselves).

The NumPy codecs of the 2:4 metadata format (`np_pack_meta`,
`np_unpack_meta`, `np_decompress`) are written straight from the format's
description in `kernels/_common.py`, loop by loop, as an independent check of
the jnp / in-kernel packing.

Every kernel test body runs twice through the `MODES` parametrisation:
interpret=True on any machine, and interpret=False (native Triton) marked
`gpu`, which the root conftest skips unless jax's default backend is a GPU.
"""
from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from . import _common as c
from . import aot
from .cusparselt import algorithms as cusparselt_algorithms

MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="native", marks=pytest.mark.gpu),
]

TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_gpu(fn, *args, gpu: str = "h100") -> str:
  """StableHLO text of fn(*args) lowered for CUDA, even on a CPU-only jaxlib.

  This runs the Pallas -> Triton-IR lowering (every Triton-backend rule:
  unsupported primitives, non-power-of-two tensors, bad dot shapes in the
  lowering's own checks) without a GPU. It does not run the Triton compiler,
  so what only ptxas would reject is still untested without a GPU. The GPU
  is named through an abstract device, which jax >= 0.11 requires without a
  GPU (`aot.abstract_gpu`; jax 0.10.2 lowers for an H100's 9.0 regardless).
  """
  with aot.abstract_gpu(gpu):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


def assert_lowers_to_triton(fn, *args, expected_calls: int | None = None):
  text = lower_for_gpu(fn, *args)
  n = text.count(TRITON_CALL)
  assert n >= 1, "no Triton custom call in the lowered module"
  if expected_calls is not None:
    assert n == expected_calls, f"{n} Triton calls, expected {expected_calls}"
  return n


def np_pack_meta(idx, k: int) -> np.ndarray:
  """idx [rows, G, 2] sorted kept positions -> meta [rows, ceil(K/32)] uint32."""
  idx = np.asarray(idx)
  rows, g, _ = idx.shape
  meta = np.zeros((rows, c.meta_words(k)), np.uint64)
  for r in range(rows):
    for q in range(meta.shape[1]):
      word = 0
      for s in range(c.GROUPS_PER_WORD):
        gi = c.GROUPS_PER_WORD * q + s
        nib = ((int(idx[r, gi, 0]) | (int(idx[r, gi, 1]) << 2)) if gi < g
               else c.EMPTY_NIBBLE)
        word |= nib << (4 * s)
      meta[r, q] = word
  return meta.astype(np.uint32)


def np_unpack_meta(meta, k: int) -> np.ndarray:
  """meta [rows, ceil(K/32)] -> idx [rows, K/4, 2] (i0, i1) per group."""
  meta = np.asarray(meta)
  rows, g = meta.shape[0], k // 4
  idx = np.zeros((rows, g, 2), np.int64)
  for r in range(rows):
    for gi in range(g):
      nib = (int(meta[r, gi // c.GROUPS_PER_WORD])
             >> (4 * (gi % c.GROUPS_PER_WORD))) & 15
      idx[r, gi] = (nib & 3, nib >> 2)
  return idx


def np_decompress(values, meta) -> np.ndarray:
  """(values [rows, K/2], meta) -> dense [rows, K] float32."""
  values = np.asarray(values, np.float32)
  rows, half = values.shape
  idx = np_unpack_meta(meta, 2 * half)
  w = np.zeros((rows, 2 * half), np.float32)
  for r in range(rows):
    for g in range(half // 2):
      w[r, 4 * g + idx[r, g, 0]] = values[r, 2 * g]
      w[r, 4 * g + idx[r, g, 1]] = values[r, 2 * g + 1]
  return w


# ---------------------------------------------------------------------------------------------
# FP8 GEMMs on tensor cores: the error bound a comparison allows, from the arithmetic.
#
# Hopper's (and Ada's) FP8 MMA does not accumulate in float32. Each MMA instruction adds its
# products to the accumulator in fixed point: every term (the products and the accumulator)
# is right-shifted to the largest exponent among them, only the highest 14 bits are kept and
# the rest truncated (DeepSeek-V3 technical report, arXiv 2412.19437, sections 3.3.2 and 3.5.2:
# "around 14 bits" on H800), and the sum is held as e8m13, the float32 accumulator with its 10
# low mantissa bits truncated (SageAttention2, arXiv 2411.10958, measured on Ada and Hopper
# with mma f32.f8.f8.f32). cuBLASLt's FP8 GEMM without "fast accumulation" promotes partial
# sums to float32 every few instructions (CUBLASLT_MATMUL_DESC_FAST_ACCUM; DeepGEMM does the
# same by hand), which only shortens the chains below. The H100 run (2026-11-27) measured up
# to 0.0098 between cuSPARSELt's FP8 GEMM and a float32 one on outputs near 20 (K = 128).
#
# The bound. Each truncation loses less than one unit of 2^-13 times the largest term it
# aligns to, and every term and partial sum is at most S = sum_i |a_i b_i| (to first order),
# so |D - A B| <= gamma(c, 2^-13) S, gamma(n, u) = n u / (1 - n u) (Higham, "Accuracy and
# Stability of Numerical Algorithms", ch. 3), with c = the nonzero products (each truncated at
# most once) + 2 per instruction (the accumulator's alignment and the sum's e8m13 rounding);
# an FP8 MMA covers at least 32 of K (PTX: mma.m16n8k32, wgmma k = 32), so at most
# ceil(K / 32) instructions. Products of two FP8 values are exact (at most 8 significant
# bits). Added: gamma(K + 10, 2^-24) S for a float32 reference or epilogue (a float32 sum of
# K terms; the dequantizing scale's two reciprocals, which XLA's GPU backend divides with
# PTX div.full, at most 2 ulp each, and two multiplies).
# Linear in c, not the sqrt(c) of a probabilistic bound: truncation errs in one direction (the
# sign-fill shift floors), so the errors do not cancel in expectation (DeepSeek-V3 measured a
# maximum relative error near 2 % at K = 4096), and a test asserts every one of 10^5 elements.

# e8m13 (14 significant bits) and the smallest K of an FP8 MMA instruction: the facts
# kernels/cusparselt/algorithms.py states once.
FP8_ACCUMULATOR_FRACTION_BITS = -int(math.log2(cusparselt_algorithms.FP8_ACCUMULATOR_UNIT))
FP8_MMA_MIN_K = cusparselt_algorithms.FP8_MMA_MIN_K


def _gamma(n, unit_roundoff):
  nu = n * unit_roundoff
  return nu / (1.0 - nu)


def fp8_gemm_error_bound(a, b) -> np.ndarray:
  """The largest |D - a @ b| (elementwise, float64 (M, N)) of a GEMM of FP8 operands on Hopper
  or Ada tensor cores, or in float32 (CPU, reference), against the exact product. `a` (M, K)
  and `b` (K, N) are the values the GEMM multiplies, dequantized (scales included)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  k = a.shape[-1]
  abs_sum = np.abs(a) @ np.abs(b)                                      # (M, N): S
  products = (a != 0).astype(np.float64) @ (b != 0).astype(np.float64)  # (M, N)
  truncations = products + 2 * -(-k // FP8_MMA_MIN_K)
  return (_gamma(truncations, 2.0 ** -FP8_ACCUMULATOR_FRACTION_BITS)
          + _gamma(k + 10, 2.0 ** -24)) * abs_sum


def bound_violations(actual, desired, bound) -> np.ndarray:
  """The elements where |actual - desired| exceeds `bound` (a boolean array)."""
  err = np.abs(np.asarray(actual, np.float64) - np.asarray(desired, np.float64))
  return ~(err <= bound)   # NaN counts as a violation


def assert_within_bound(actual, desired, bound, what: str = "") -> None:
  """|actual - desired| <= bound elementwise, else an AssertionError naming the worst element."""
  actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
  bound = np.broadcast_to(np.asarray(bound, np.float64), desired.shape)
  assert actual.shape == desired.shape, (what, actual.shape, desired.shape)
  bad = bound_violations(actual, desired, bound)
  if bad.any():
    excess = np.where(bad, np.abs(actual - desired) - bound, -np.inf)
    i = np.unravel_index(np.nanargmax(np.nan_to_num(excess, nan=np.inf)), excess.shape)
    raise AssertionError(
        f"{what}: {int(bad.sum())} of {bad.size} elements beyond the error bound; worst at "
        f"{tuple(int(j) for j in i)}: |{actual[i]!r} - {desired[i]!r}| = "
        f"{abs(actual[i] - desired[i])!r} > {bound[i]!r}")


def np_fp8_tensor_core_matmul(a, b, *, block: int = FP8_MMA_MIN_K,
                              fraction_bits: int = FP8_ACCUMULATOR_FRACTION_BITS) -> np.ndarray:
  """a (M, K) @ b (K, N) as the model above accumulates it (the bound's premise, not a
  measurement): per `block` of K, the accumulator and the block's products are aligned to the
  largest exponent among them and floored to `fraction_bits` below it, summed, and the sum
  truncated toward zero to fraction_bits + 1 significant bits. float64 (M, N)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  acc = np.zeros((a.shape[0], b.shape[1]))
  for k0 in range(0, a.shape[1], block):
    products = a[:, None, k0:k0 + block] * b.T[None, :, k0:k0 + block]   # (M, N, block), exact
    terms = np.concatenate([acc[..., None], products], axis=-1)
    unit = _unit(np.max(np.abs(terms), axis=-1), fraction_bits)[..., None]
    total = np.sum(np.floor(terms / unit) * unit, axis=-1)                # exact in float64
    unit = _unit(np.abs(total), fraction_bits)
    acc = np.trunc(total / unit) * unit
  return acc


def _unit(magnitude, fraction_bits):
  """2^(floor(log2 magnitude) - fraction_bits), 1 where magnitude is 0."""
  exponent = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
  return np.exp2(exponent - fraction_bits)
