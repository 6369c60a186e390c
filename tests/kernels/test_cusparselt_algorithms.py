"""Tests of s24jax.kernels.cusparselt.algorithms: the algorithm as data, the library's search,
and the check of an algorithm against the default selection.

On the CPU: the Algorithm's fields and their validation; the stand-in path of `search` and
`check_against_default`; the agreement bound against a float64 brute force of its formula,
with a perturbation just above it flagged and one just below it not, and against models of
two algorithms' arithmetic (float32 sums in different orders and splits; FP8 tensor-core
accumulation in MMA blocks of 32 and 64, kernels/_testing.py) that must stay inside it while
a wrong result must not; a deviceless H100 compile (`aot`) of compress, search and spmm under
an algorithm. On a GPU (`gpu`): the search's algorithm id lies in [0, max_id), and every
algorithm id agrees with the default, and with the exact product, for bf16 and e4m3.
The handlers' bindings of these calls: test_cusparselt_library.py.
"""
import functools
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from s24jax.kernels import masks
from s24jax.kernels._testing import FP8_ACCUMULATOR_FRACTION_BITS
from s24jax.kernels._testing import FP8_MMA_MIN_K
from s24jax.kernels._testing import np_fp8_tensor_core_matmul
from s24jax.kernels.cusparselt import algorithms
from s24jax.kernels.cusparselt import library
from s24jax.kernels.cusparselt import ops

Algorithm = algorithms.Algorithm


def _normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _sparse(seed, shape, dtype, along_rows=False):
  """A 2:4 array: groups of 4 along its last axis (along its first with along_rows)."""
  x = _normal(seed, shape)
  m = masks.nm_mask(x.T).T if along_rows else masks.nm_mask(x)
  return jnp.where(m, x, 0).astype(dtype)


def _operands(g: ops.Gemm, dtype):
  """A (2:4 along k) and B arrays of `g` in `dtype`, and op(A) (m, k), op(B) (k, n) in
  float64."""
  a = _sparse(0, g.a_shape(), dtype, along_rows=not g.trans_a)
  b = _normal(1, g.b_shape()).astype(dtype)
  op_a = np.asarray(a, np.float64) if g.trans_a else np.asarray(a, np.float64).T
  op_b = np.asarray(b, np.float64) if g.trans_b else np.asarray(b, np.float64).T
  return a, b, op_a, op_b


def test_an_algorithm_is_checked_data_in_the_order_the_search_returns():
  assert algorithms.DEFAULT == Algorithm(alg_id=-1, split_k=1, split_k_mode=0,
                                         split_k_buffers=1)
  assert Algorithm(np.int32(3), split_k=4).attrs() == {
      "alg_id": 3, "split_k": 4, "split_k_mode": 0, "split_k_buffers": 1}
  assert type(Algorithm(np.int32(3)).alg_id) is int
  assert algorithms.SEARCH_RESULT == ("alg_id", "split_k", "split_k_mode", "split_k_buffers",
                                      "alg_config_max_id")
  for bad, field in (((-2,), "alg_id=-2"), ((0, 2 ** 31), "split_k=2147483648"),
                     ((1.0,), "alg_id=1.0"), ((True,), "alg_id=True")):
    with pytest.raises(ValueError, match=rf"^cuSPARSELt Algorithm: {field} must be an int"):
      Algorithm(*bad)


def test_under_the_standin_search_and_check_call_no_library():
  """search returns (Algorithm(0), 1) and spmm ignores the algorithm, so the check finds the
  two runs equal; search_call is jittable, search itself needs concrete arrays; search takes
  spmm's operands and refuses others as spmm does."""
  g = ops.Gemm(m=32, n=16, k=64, trans_a=True, trans_b=False)
  a, b, _, _ = _operands(g, jnp.bfloat16)
  kw = dict(a_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16)
  with ops.standin():
    c = ops.compress(a, g, b_dtype=b.dtype, d_dtype=jnp.bfloat16)
    assert algorithms.search(c, b, g, **kw) == (Algorithm(0), 1)
    found = jax.jit(functools.partial(algorithms.search_call, gemm=g, **kw))(c, b)
    assert found.dtype == jnp.int32 and found.tolist() == [0, 1, 0, 1, 1]
    with pytest.raises(TypeError, match="concrete arrays; inside jit, call search_call"):
      jax.jit(lambda c, b: algorithms.search(c, b, g, **kw))(c, b)
    with pytest.raises(ValueError, match=r"B has shape \(8, 64\)"):
      algorithms.search(c, b[:8], g, **kw)
    assert algorithms.check_against_default(c, b, g, Algorithm(2, split_k=4), **kw) is None


# ---------------------------------------------------------------------------------------------
# The agreement bound.

# (A's dtype, D's dtype, the GEMM): 16-bit in every layout the test uses, FP8 in TN (R3).
_CASES = [(jnp.bfloat16, jnp.bfloat16, ops.Gemm(32, 16, 64, False, False, d_row_major=True)),
          (jnp.float8_e4m3fn, jnp.float32, ops.Gemm(32, 16, 64, True, False))]


def _brute_force_bound(op_a, op_b, a_dtype, out_dtype) -> np.ndarray:
  """The bound's formula in float64, one output at a time: 2 gamma(c, u) S + eps_out (1 +
  gamma) S + the output's smallest normal, with u and c of the accumulator (float32: 2^-23 per
  addition, k of them; FP8: 14 significant bits, k + 2 per MMA of FP8_MMA_MIN_K)."""
  m, k = op_a.shape
  if jnp.dtype(a_dtype).itemsize == 1:
    u, c = 2.0 ** -FP8_ACCUMULATOR_FRACTION_BITS, k + 2 * math.ceil(k / FP8_MMA_MIN_K)
  else:
    u, c = float(np.finfo(np.float32).eps), k
  gamma = c * u / (1 - c * u)
  out = ml_dtypes.finfo(out_dtype)
  bound = np.empty((m, op_b.shape[1]))
  for i in range(m):
    for j in range(op_b.shape[1]):
      s = sum(abs(op_a[i, kk]) * abs(op_b[kk, j]) for kk in range(k))
      bound[i, j] = (2 * gamma + float(out.eps) * (1 + gamma)) * s + float(out.tiny)
  return bound


@pytest.mark.parametrize("a_dtype,out_dtype,g", _CASES)
def test_the_bound_is_its_formula_and_flags_just_beyond_it(a_dtype, out_dtype, g):
  """agreement_bound against the float64 brute force; then D arrays differing at one output
  by 1.01 times the bound are flagged (naming the algorithm and the output), by 0.99 not."""
  _, _, op_a, op_b = _operands(g, a_dtype)
  want = _brute_force_bound(op_a, op_b, a_dtype, out_dtype)                  # (m, n)
  bound = np.asarray(algorithms.agreement_bound(op_a, op_b, a_dtype=a_dtype,
                                                out_dtype=out_dtype), np.float64)
  np.testing.assert_allclose(bound, want, rtol=1e-5)
  d_default = (op_a @ op_b).astype(np.float32)                               # a D, (m, n)
  at, alg = (3, 5), Algorithm(7, split_k=2)
  for factor, flagged in ((1.01, True), (0.99, False)):
    d_alg = d_default.copy()
    d_alg[at] = np.float32(d_default[at] + factor * want[at])
    moved = abs(float(d_alg[at]) - float(d_default[at]))
    assert (moved > want[at]) == flagged                                    # as constructed
    line = algorithms.disagreement(d_alg, d_default, bound, alg)
    assert (line is not None) == flagged, line
    if flagged:
      assert str(alg) in line and "on 1 of 512 outputs" in line and "(3, 5)" in line
      assert "\n" not in line
  with_nans = d_default.copy()
  with_nans[0, :2] = np.nan                                                  # never agrees
  assert "on 2 of 512 outputs" in algorithms.disagreement(with_nans, d_default, bound, alg)


def _f32_sums(op_a, op_b, split_k: int) -> np.ndarray:
  """op_a @ op_b as float32 arithmetic does it: k products (exact) added in order within
  each of `split_k` chunks of k, and the chunks' sums added last to first."""
  a, b = op_a.astype(np.float32), op_b.astype(np.float32)
  chunks = np.array_split(np.arange(a.shape[1]), split_k)
  chunk_sums = []
  for chunk in chunks:
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for kk in chunk:
      acc = acc + a[:, kk, None] * b[None, kk, :]
    chunk_sums.append(acc)
  total = np.zeros_like(chunk_sums[0])
  for acc in reversed(chunk_sums):
    total = total + acc
  return total


@pytest.mark.parametrize("a_dtype,out_dtype,g", _CASES)
def test_two_algorithms_arithmetic_stays_inside_and_a_wrong_result_does_not(a_dtype, out_dtype,
                                                                             g):
  """Models of two algorithms on the same operands (16-bit: float32 sums in order and split
  in 4; FP8: tensor-core accumulation in MMA blocks of 32 and of 64), rounded to D's dtype,
  agree within the bound although they differ; with the largest kept value of a row of A
  dropped, the result is flagged. For FP8 the float32 bound alone would flag the two models:
  the accumulator's 14 bits are needed."""
  _, _, op_a, op_b = _operands(g, a_dtype)
  if jnp.dtype(a_dtype).itemsize == 1:
    model = functools.partial(np_fp8_tensor_core_matmul, op_a, op_b)
    first, second = model(block=32), model(block=64)
  else:
    first, second = _f32_sums(op_a, op_b, 1), _f32_sums(op_a, op_b, 4)
  assert np.any(first != second)                                    # the orders do differ
  def as_out(d):   # D as the GEMM writes it
    return np.asarray(jnp.asarray(d, jnp.float32).astype(out_dtype), np.float64)

  bound = algorithms.agreement_bound(op_a, op_b, a_dtype=a_dtype, out_dtype=out_dtype)
  alg = Algorithm(1)
  assert algorithms.disagreement(as_out(first), as_out(second), bound, alg) is None
  dropped = op_a.copy()
  dropped[0, np.argmax(np.abs(op_a[0]))] = 0
  assert algorithms.disagreement(as_out(dropped @ op_b), as_out(first), bound, alg)
  if jnp.dtype(a_dtype).itemsize == 1:
    f32_only = algorithms.agreement_bound(op_a, op_b, a_dtype=jnp.bfloat16, out_dtype=out_dtype)
    assert algorithms.disagreement(as_out(first), as_out(second), f32_only, alg)


# ---------------------------------------------------------------------------------------------
# A deviceless H100 compile: the three calls, their targets and attributes, kept by XLA.

_AOT = """
import json, re
import jax, jax.numpy as jnp
from s24jax.kernels import aot
aot.start()
from s24jax.kernels.cusparselt import algorithms
from s24jax.kernels.cusparselt import ops
g = ops.Gemm(m=64, n=32, k=64, trans_a=True, trans_b=False)
alg = algorithms.Algorithm(3, split_k=2, split_k_mode=1, split_k_buffers=4)
def step(a, b):
  c = ops.compress(a, g, b_dtype=b.dtype, d_dtype=jnp.float32)
  found = algorithms.search_call(c, b, g, a_dtype=a.dtype, out_dtype=jnp.float32)
  return ops.spmm(c, b, g, a_dtype=a.dtype, out_dtype=jnp.float32, alg=alg), found
specs = [aot.spec(s, jnp.float8_e4m3fn, "h100") for s in (g.a_shape(), g.b_shape())]
_, compiled = aot.compile_for_gpu(step, *specs, gpu="h100")
calls = []
for line in compiled.as_text().splitlines():
  m = re.search(r'= (\\w+\\[[\\d,]*\\]).* custom-call\\(.*custom_call_target="(\\w+)".*'
                r'backend_config=\\{([^}]*)\\}', line)
  if m:
    attrs = dict(re.match(r'\\s*(\\w+) = "?([\\w-]+)', kv).groups() for kv in m[3].split(","))
    calls.append({"out": m[1], "target": m[2], **attrs})
print(json.dumps(calls))
"""


@pytest.mark.slow   # a subprocess: aot.start must come before jax starts a backend
@pytest.mark.aot
def test_deviceless_h100_compile_keeps_compress_search_and_spmm():
  """One jitted function: compress, search_call and spmm under Algorithm(3, 2, 1, 4), e4m3 TN
  with a float32 D, compiled for an H100 without a GPU: three custom calls, each with its
  target, its operands' result type and the attributes the handler binds."""
  try:
    library.toolchain()
  except library.Unavailable as e:
    pytest.skip(str(e))
  run = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  calls = {c["target"]: c for c in json.loads(run.stdout.strip().splitlines()[-1])}
  assert sorted(calls) == sorted(library.TARGETS)
  gemm = {"m": "64", "n": "32", "k": "64", "trans_a": "true", "trans_b": "false",
          "d_row_major": "false"}
  want = {
      "cusparselt_compress": {"out": "u8[2560]", "b_dtype": "e4m3", "d_dtype": "f32"},
      "cusparselt_search": {"out": "s32[5]", "a_dtype": "e4m3", "d_dtype": "f32"},
      "cusparselt_spmm": {"out": "f32[32,64]", "a_dtype": "e4m3", "alg_id": "3",
                          "split_k": "2", "split_k_mode": "1", "split_k_buffers": "4"},
  }
  for target, call in calls.items():
    assert call == {"target": target, **gemm, **want[target]}, call


# ---------------------------------------------------------------------------------------------
# On a GPU.

_GPU_CASES = [(jnp.bfloat16, jnp.bfloat16), (jnp.float8_e4m3fn, jnp.float32)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,out_dtype", _GPU_CASES)
def test_gpu_search_finds_an_algorithm_id_below_its_max(dtype, out_dtype):
  g = ops.Gemm(m=256, n=512, k=256, trans_a=True, trans_b=False)
  a, b, _, _ = _operands(g, dtype)
  c = jax.jit(functools.partial(ops.compress, gemm=g, b_dtype=dtype, d_dtype=out_dtype))(a)
  found = jax.jit(functools.partial(algorithms.search_call, gemm=g, a_dtype=dtype,
                                    out_dtype=out_dtype))(c, b)
  assert found.shape == (5,) and found.dtype == jnp.int32
  alg, max_id = algorithms.search(c, b, g, a_dtype=dtype, out_dtype=out_dtype)
  assert max_id >= 1 and 0 <= alg.alg_id < max_id, (alg, max_id)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,out_dtype", _GPU_CASES)
def test_gpu_every_algorithm_agrees_with_the_default_and_the_exact_product(dtype, out_dtype):
  """The searched algorithm and every alg id: within the bound of the default's D, and D
  within the bound of the exact float64 product (which a single result meets with room)."""
  g = ops.Gemm(m=256, n=512, k=256, trans_a=True, trans_b=False)
  a, b, op_a, op_b = _operands(g, dtype)
  c = jax.jit(functools.partial(ops.compress, gemm=g, b_dtype=dtype, d_dtype=out_dtype))(a)
  kw = dict(a_dtype=dtype, out_dtype=out_dtype)
  searched, max_id = algorithms.search(c, b, g, **kw)
  bound = np.asarray(algorithms.agreement_bound(op_a, op_b, **kw)).T         # the D array's
  exact = (op_a @ op_b).T
  for alg in {searched, *(Algorithm(i) for i in range(max_id))}:
    assert algorithms.check_against_default(c, b, g, alg, **kw) is None, alg
    d = jax.jit(functools.partial(ops.spmm, gemm=g, alg=alg, **kw))(c, b)
    assert algorithms.disagreement(d, exact, bound, alg) is None
