"""Tests of s24jax.sparse_ops.fp8: per-tensor amax quantization (quantize / dequantize / scales) and the
FP8 GEMMs fp8_dot / fp8_dot_general.

The rounding reference is a brute force over all 256 bit patterns of each float8 format
(nearest finite value, ties to the even bit pattern), not a cast; the GEMMs are checked
against float64 products of the dequantized operands and against float32 products (relative
error bounds from the formats' mantissa widths). The FP8 path of the sparse linear op:
tests/sparse_ops/test_fp8_gemms.py.
"""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from s24jax.sparse_ops import fp8
from s24jax.kernels import _common

FORMATS = [(fp8.E4M3, ml_dtypes.float8_e4m3fn, 3), (fp8.E5M2, ml_dtypes.float8_e5m2, 2)]


def _finite_values(np_dtype) -> tuple[np.ndarray, np.ndarray]:
  """All finite values of a float8 format (float64) and their bit patterns."""
  bits = np.arange(256, dtype=np.uint8)
  values = bits.view(np_dtype).astype(np.float64)
  keep = np.isfinite(values)
  return values[keep], bits[keep]


def _round_brute_force(x: np.ndarray, np_dtype) -> np.ndarray:
  """Nearest finite float8 value of each x (already within +-fmax); ties to the even pattern."""
  values, bits = _finite_values(np_dtype)
  dist = np.abs(x.reshape(-1, 1).astype(np.float64) - values[None, :])   # (n, 256)
  best = dist.min(axis=1, keepdims=True)
  ties = dist == best
  # Among the tied candidates prefer an even bit pattern (round half to even).
  pref = np.where(ties, np.where(bits[None, :] % 2 == 0, 0, 1), 2)
  return values[np.argmin(pref, axis=1)].reshape(x.shape)


@pytest.mark.parametrize("dtype,np_dtype,mbits", FORMATS)
def test_quantize_matches_brute_force_rounding(dtype, np_dtype, mbits):
  del mbits
  x = np.array(jax.random.normal(jax.random.PRNGKey(0), (33, 7)) * 3.0)
  x[0, :3] = [0.0, -1e-12, 1e-30]      # zero, and values that flush to zero
  q, scale = fp8.quantize(jnp.asarray(x), dtype)
  assert q.dtype == jnp.dtype(dtype)
  np.testing.assert_allclose(float(scale), fp8.fmax(dtype) / np.abs(x).max(), rtol=1e-6)
  want = _round_brute_force(np.float32(x) * np.float32(scale), np_dtype)
  np.testing.assert_array_equal(np.asarray(q).astype(np.float64), want)


@pytest.mark.parametrize("dtype,np_dtype,mbits", FORMATS)
def test_round_trip_within_format_precision(dtype, np_dtype, mbits):
  # Magnitudes over 12 binades below amax, random signs.
  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  x = jnp.exp2(jax.random.uniform(k1, (4096,), minval=-12.0, maxval=0.0))
  x = jnp.where(jax.random.bernoulli(k2, 0.5, x.shape), x, -x) * 5.0
  q, scale = fp8.quantize(x, dtype)
  back = np.asarray(fp8.dequantize(q, scale))
  x, scaled = np.asarray(x), np.abs(np.asarray(x)) * float(scale)
  normal = scaled >= float(jnp.finfo(dtype).tiny)
  rel = np.abs(back - x)[normal] / np.abs(x)[normal]
  # Round to nearest: half an ulp, 2^-(mbits+1) (e4m3: 2^-4, e5m2: 2^-3), tighter than one ulp.
  assert rel.max() <= 2.0 ** -(mbits + 1) * (1 + 1e-6)
  assert rel.max() > 2.0 ** -(mbits + 3)      # and the rounding is really there
  # Subnormals: absolute error at most half the subnormal spacing, in x's units.
  sub_step = float(jnp.finfo(dtype).smallest_subnormal)
  assert np.all(np.abs(back - x)[~normal] <= 0.5 * sub_step / float(scale) * (1 + 1e-6))


@pytest.mark.parametrize("dtype,np_dtype,mbits", FORMATS)
def test_amax_maps_to_max_finite_value(dtype, np_dtype, mbits):
  del np_dtype, mbits
  x = jnp.array([[0.5, -3.25, 1.0], [2.0, 0.1, -0.7]])
  q, scale = fp8.quantize(x, dtype)
  assert float(q[0, 1]) == -fp8.fmax(dtype)
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == fp8.fmax(dtype)
  np.testing.assert_allclose(float(fp8.dequantize(q, scale)[0, 1]), -3.25, rtol=1e-6)


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_quantize_saturates_instead_of_nan(dtype):
  x = jnp.array([1.0, -1.0, 1e3, -1e6])
  q, _ = fp8.quantize(x, dtype, scale=jnp.float32(1e3))   # way out of range
  assert not bool(jnp.any(jnp.isnan(q.astype(jnp.float32))))
  np.testing.assert_array_equal(np.abs(np.asarray(q.astype(jnp.float32)))[2:],
                                fp8.fmax(dtype))


def test_zero_tensor_quantizes_to_zero_with_unit_scale():
  q, scale = fp8.quantize(jnp.zeros((3, 4)), fp8.E4M3)
  assert float(scale) == 1.0
  assert not bool(jnp.any(q.astype(jnp.float32)))


def test_unknown_format_is_rejected():
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    fp8.quantize(jnp.ones(3), jnp.bfloat16)


@pytest.mark.parametrize("a_dtype,b_dtype", [(fp8.E4M3, fp8.E4M3), (fp8.E5M2, fp8.E4M3),
                                             (fp8.E5M2, fp8.E5M2)])
def test_fp8_dot_equals_dequantized_float64_product(a_dtype, b_dtype):
  k1, k2 = jax.random.split(jax.random.PRNGKey(2))
  a = jax.random.normal(k1, (3, 5, 32))
  b = jax.random.normal(k2, (32, 24)) * 0.02
  got = np.asarray(fp8.fp8_dot(a, b, a_dtype=a_dtype, b_dtype=b_dtype))
  assert got.shape == (3, 5, 24) and got.dtype == np.float32
  qa, sa = fp8.quantize(a, a_dtype)
  qb, sb = fp8.quantize(b, b_dtype)
  deq_a = np.asarray(qa).astype(np.float64) / float(sa)
  deq_b = np.asarray(qb).astype(np.float64) / float(sb)
  np.testing.assert_allclose(got, deq_a @ deq_b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("a_dtype,bound", [(fp8.E4M3, 0.05), (fp8.E5M2, 0.09)])
def test_fp8_dot_relative_error_to_float32(a_dtype, bound):
  # Gaussian operands: per-element relative rounding error ~2^-(m+1)/sqrt(3) each, so the
  # product's relative Frobenius error is a few percent (e4m3) / twice that (e5m2 x e4m3).
  errors = []
  for seed in range(3):
    k1, k2 = jax.random.split(jax.random.PRNGKey(10 + seed))
    a = jax.random.normal(k1, (64, 128))
    b = jax.random.normal(k2, (128, 48))
    exact = a @ b
    got = fp8.fp8_dot(a, b, a_dtype=a_dtype)
    errors.append(float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact)))
  assert max(errors) <= bound, errors
  assert min(errors) > 1e-3, errors   # it is really quantized


def test_fp8_dot_rejects_mismatched_contraction():
  with pytest.raises(ValueError, match="contraction"):
    fp8.fp8_dot(jnp.ones((2, 8)), jnp.ones((4, 3)))


@pytest.mark.parametrize("platform,wide", [("gpu", "bf16"), ("cpu", "f32")])
def test_e5m2_by_e5m2_runs_as_the_bf16_gemm_of_the_same_values(monkeypatch, platform, wide):
  """No FP8 GEMM takes two e5m2 operands: for a GPU the dot is bf16 x bf16 (e5m2 converts to
  bf16 exactly: every e5m2 value, subnormals included, round-trips), elsewhere float32; the
  other pairs stay FP8."""
  monkeypatch.setattr(_common, "target_device", lambda: types.SimpleNamespace(platform=platform))
  every = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e5m2)
  finite = every[np.isfinite(every.astype(np.float32))]
  assert np.array_equal(finite.astype(ml_dtypes.bfloat16).astype(ml_dtypes.float8_e5m2)
                        .view(np.uint8), finite.view(np.uint8))
  one = jnp.float32(1.0)
  def dot_line(a_dtype, b_dtype):     # the dot's operand and result types, as lowered
    hlo = jax.jit(lambda a, b: fp8.scaled_dot_general(a, one, b, one, (((1,), (0,)), ((), ())),
                                                      jnp.float32)).lower(
        jnp.zeros((8, 16), a_dtype), jnp.zeros((16, 4), b_dtype)).as_text()
    [line] = [l for l in hlo.splitlines() if "stablehlo.dot_general" in l]
    return line.split(" : ")[-1]
  assert dot_line(fp8.E5M2, fp8.E5M2) == (f"(tensor<8x16x{wide}>, tensor<16x4x{wide}>) -> "
                                          "tensor<8x4xf32>")
  assert dot_line(fp8.E5M2, fp8.E4M3) == ("(tensor<8x16xf8E5M2>, tensor<16x4xf8E4M3FN>) -> "
                                          "tensor<8x4xf32>")
