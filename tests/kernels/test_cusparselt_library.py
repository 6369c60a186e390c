"""Tests of s24jax.kernels.cusparselt (library.py: the FFI handlers' build and registration;
ops.py: the Gemm convention, `compress` / `spmm` and their jnp stand-in).

The stand-in is checked against NumPy products written from ops.py's column-major
convention (op(A) op(B), each array read as the docstring says); the shapes cuSPARSELt cannot
take and the device check against their documented errors; the library build (g++ against
jaxlib's FFI headers and the cuSPARSELt wheels, no GPU needed) by the symbols of the built
file; on a GPU (`gpu`), the real handlers against the stand-in. The sparse op's backend built
on these calls: tests/sparse_ops/test_cusparselt_backend.py. The handlers' scratch under XLA's
FFI contract: tests/kernels/test_cusparselt_scratch.py.

FP8 on a GPU: the library's tensor cores accumulate with 14 significant bits and truncate, so
the FP8 handlers are compared with the exact product within `fp8_gemm_error_bound`
(kernels/_testing.py, derived from that arithmetic); a CPU test checks that bound against a
model of the accumulation and against the mistakes it must still catch.
"""
import subprocess

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from s24jax.kernels import masks
from s24jax.kernels._testing import assert_within_bound
from s24jax.kernels._testing import bound_violations
from s24jax.kernels._testing import fp8_gemm_error_bound
from s24jax.kernels._testing import np_fp8_tensor_core_matmul
from s24jax.kernels.cusparselt import library
from s24jax.kernels.cusparselt import ops as cusparselt


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _sparse(seed, shape, dtype, along_rows=False):
  """A 2:4 array: groups of 4 along its last axis (along its first with along_rows)."""
  x = _normal(seed, shape)
  m = masks.nm_mask(x.T).T if along_rows else masks.nm_mask(x)
  return jnp.where(m, x, 0).astype(dtype)


@pytest.mark.parametrize("trans_a,trans_b", [(True, False), (False, False), (True, True),
                                             (False, True)])
def test_standin_follows_the_column_major_convention(trans_a, trans_b):
  """D = op(A) op(B) with each array read as the docstring says, against NumPy (bf16
  operands: every layout is one the library takes for 16-bit types)."""
  g = cusparselt.Gemm(m=32, n=48, k=64, trans_a=trans_a, trans_b=trans_b)
  a = _sparse(0, g.a_shape(), jnp.bfloat16, along_rows=not trans_a)   # 2:4 along k
  b = _normal(1, g.b_shape()).astype(jnp.bfloat16)
  op_a = np.asarray(a, np.float32) if trans_a else np.asarray(a, np.float32).T   # (m, k)
  op_b = np.asarray(b, np.float32) if trans_b else np.asarray(b, np.float32).T   # (k, n)
  want = (op_a @ op_b).T                # the D array: D^T, (n, m)
  with cusparselt.standin():
    c = cusparselt.compress(a, g, b_dtype=jnp.bfloat16, d_dtype=jnp.bfloat16)
    # the compressed size of the rules (R9): 9/16 of A's bytes for a 16-bit type
    assert c.dtype == jnp.uint8 and c.shape == (a.size * 2 * 9 // 16,)
    d = cusparselt.spmm(c, b, g, a_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16)
  assert d.shape == g.d_shape() == want.shape
  np.testing.assert_allclose(np.asarray(d, np.float32), want, rtol=1e-2, atol=1e-2)


def test_standin_compression_keeps_a_24_operand_and_drops_what_is_not():
  """The stand-in's buffer holds a real 2:4 compression: a 2:4 operand comes back exactly
  (bf16, e4m3; read back as A I, a GEMM with the identity), and a dense one loses the two
  smallest magnitudes of each group of 4, as the library's compression would."""
  g = cusparselt.Gemm(m=32, n=64, k=64, trans_a=True, trans_b=False)   # D^T = (A I)^T

  def round_trip(a, dtype, d_dtype):
    with cusparselt.standin():
      c = cusparselt.compress(a, g, b_dtype=dtype, d_dtype=d_dtype)
      d = cusparselt.spmm(c, jnp.eye(g.k, dtype=dtype), g, a_dtype=dtype, out_dtype=d_dtype)
    return np.asarray(d, np.float32).T                           # (m, k)

  for dtype, d_dtype in ((jnp.bfloat16, jnp.bfloat16), (jnp.float8_e4m3fn, jnp.float32)):
    a = _sparse(2, g.a_shape(), dtype)
    np.testing.assert_array_equal(round_trip(a, dtype, d_dtype), np.asarray(a, np.float32))
  dense = _normal(3, g.a_shape()).astype(jnp.bfloat16)
  want = np.where(np.asarray(masks.nm_mask(dense)), np.asarray(dense, np.float32), 0)
  np.testing.assert_array_equal(round_trip(dense, jnp.bfloat16, jnp.bfloat16), want)


def test_gemms_the_library_refuses_are_refused_naming_the_rule():
  g = cusparselt.Gemm(m=32, n=48, k=36, trans_a=True, trans_b=False)
  with cusparselt.standin(), pytest.raises(ValueError, match=r"k=36.*multiple of 16.*R5"):
    cusparselt.compress(jnp.zeros(g.a_shape(), jnp.bfloat16), g, b_dtype=jnp.bfloat16,
                        d_dtype=jnp.bfloat16)
  g = cusparselt.Gemm(m=32, n=48, k=64, trans_a=False, trans_b=False)   # NN
  with cusparselt.standin(), pytest.raises(ValueError, match=r"only the TN layout.*R3"):
    cusparselt.compress(jnp.zeros(g.a_shape(), jnp.float8_e4m3fn), g,
                        b_dtype=jnp.float8_e4m3fn, d_dtype=jnp.float32)


def test_off_a_gpu_it_names_the_backend_that_runs():
  """Targeting the CPU (the default device here; set explicitly so that it holds on a GPU host
  too), the call stops before anything is built, naming the backend that runs there."""
  g = cusparselt.Gemm(m=32, n=48, k=64, trans_a=True, trans_b=False)
  with jax.default_device(jax.devices("cpu")[0]), pytest.raises(
      cusparselt.UnsupportedDevice, match=r"jax platform 'cpu'.*sparsity.backend='xla'"):
    cusparselt.compress(jnp.zeros(g.a_shape(), jnp.bfloat16), g, b_dtype=jnp.bfloat16,
                        d_dtype=jnp.bfloat16)


@pytest.mark.slow   # g++ builds the handlers (a subprocess)
def test_the_library_builds_and_registers_without_a_gpu(tmp_path, monkeypatch):
  """The real handlers: compiled with g++ against jaxlib's FFI headers and the wheels, cached
  by version, registered for CUDA. Skipped, saying why, where the wheels are not installed."""
  try:
    tools = library.toolchain()
  except library.Unavailable as e:
    assert library.INSTALL_HINT in str(e)
    pytest.skip(f"cuSPARSELt wheels not installed: {e}")
  monkeypatch.setenv("S24JAX_CACHE", str(tmp_path))
  path = library.build()
  assert path.exists() and path.parent == tmp_path / "cusparselt"
  assert f"cusparselt{tools.cusparselt_version}" in path.name and jaxlib.__version__ in path.name
  mtime = path.stat().st_mtime
  assert library.build() == path and path.stat().st_mtime == mtime   # cached, not rebuilt
  symbols = subprocess.run(["nm", "-D", str(path)], capture_output=True, text=True).stdout
  for symbol in library.TARGETS.values():
    assert symbol in symbols
  library.register.cache_clear()
  library.register()


def test_a_missing_wheel_or_compiler_is_one_clear_error(monkeypatch):
  monkeypatch.setattr(library.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(library.Unavailable, match=r"pip install -r requirements-gpu.txt"):
    library.toolchain()


# ---------------------------------------------------------------------------------------------
# On a GPU (A100 / H100): the handlers against the stand-in's jnp.


@pytest.mark.gpu
@pytest.mark.parametrize("trans_a,trans_b", [(True, False), (False, False), (True, True)])
def test_gpu_handlers_equal_jnp(trans_a, trans_b):
  g = cusparselt.Gemm(m=256, n=512, k=128, trans_a=trans_a, trans_b=trans_b)
  a = _normal(0, g.a_shape(), jnp.bfloat16)
  op_a = a if trans_a else a.T
  op_a = jnp.where(masks.nm_mask(op_a), op_a, 0)             # 2:4 along k
  a = op_a if trans_a else op_a.T
  b = _normal(1, g.b_shape(), jnp.bfloat16)
  d = jax.jit(lambda a, b: cusparselt.spmm(
      cusparselt.compress(a, g, b_dtype=b.dtype, d_dtype=b.dtype), b, g, a_dtype=a.dtype,
      out_dtype=jnp.bfloat16))(a, b)
  with cusparselt.standin():
    want = cusparselt.spmm(cusparselt.compress(a, g, b_dtype=b.dtype, d_dtype=b.dtype), b, g,
                           a_dtype=a.dtype, out_dtype=jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(d, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)


def _fp8_gemm(dtype, d_row_major=False):
  """The FP8 GEMM of the `gpu` test below: (Gemm, A array, B array, op(A), op(B)) with op(A)
  (m, k) and op(B) (k, n) in float64 (TN: A is op(A), B is op(B)^T)."""
  g = cusparselt.Gemm(m=256, n=512, k=128, trans_a=True, trans_b=False,
                      d_row_major=d_row_major)
  a = _sparse(0, g.a_shape(), dtype)                                 # (m, k), 2:4 along k
  b = _normal(1, g.b_shape()).astype(dtype)                         # (n, k)
  return g, a, b, np.asarray(a, np.float64), np.asarray(b, np.float64).T


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_the_fp8_error_bound_holds_for_tensor_core_accumulation_and_rejects_mistakes(dtype):
  """The bound the `gpu` FP8 test allows, on its operands: a model of Hopper's FP8
  accumulation (14 significant bits, truncation; kernels/_testing.py) in MMA blocks of 32 and
  64 along K stays inside it, while erring beyond the rtol=1e-5 the `gpu` test had (as the
  H100 did); the mistakes a handler could make land outside it: the largest kept value of a
  row dropped, two kept values swapped within their group (wrong metadata), D doubled."""
  _, _, _, op_a, op_b = _fp8_gemm(dtype)
  exact = op_a @ op_b                                                # (m, n)
  bound = fp8_gemm_error_bound(op_a, op_b)
  for block in (32, 64):
    model = np_fp8_tensor_core_matmul(op_a, op_b, block=block)
    assert not bound_violations(model, exact, bound).any(), block
    assert np.any(np.abs(model - exact) > 1e-4 + 1e-5 * np.abs(exact)), block
  dropped = op_a.copy()
  dropped[0, np.argmax(np.abs(op_a[0]))] = 0
  groups = op_a[0].reshape(-1, 4)                                    # row 0's groups of 4
  kept = np.argsort(groups == 0, axis=1, kind="stable")[:, :2]       # (k/4, 2) positions
  values = np.take_along_axis(groups, kept, axis=1)
  i = np.argmax(np.abs(values[:, 0] - values[:, 1]))                 # where a swap moves most
  swapped = op_a.copy()
  swapped[0, 4 * i + kept[i]] = values[i, ::-1]
  assert not np.array_equal(swapped, op_a)
  for name, wrong in (("dropped", dropped @ op_b), ("swapped", swapped @ op_b),
                      ("doubled", 2 * exact)):
    assert bound_violations(wrong, exact, bound).any(), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("d_row_major", [False, True])
def test_gpu_fp8_handlers_equal_jnp(dtype, d_row_major):
  """FP8, the TN layout (R3), float32 D in either order (R4), against the stand-in's float32
  product of the same operands, within the FP8 tensor cores' error bound (kernels/_testing.py:
  the library accumulates with 14 significant bits; the H100 run of 2026-11-27 measured up to
  0.0098 here, beyond the rtol=1e-5 this test had)."""
  g, a, b, op_a, op_b = _fp8_gemm(dtype, d_row_major)
  d = jax.jit(lambda a, b: cusparselt.spmm(
      cusparselt.compress(a, g, b_dtype=dtype, d_dtype=jnp.float32), b, g, a_dtype=dtype,
      out_dtype=jnp.float32))(a, b)
  with cusparselt.standin():
    want = cusparselt.spmm(cusparselt.compress(a, g, b_dtype=dtype, d_dtype=jnp.float32), b, g,
                           a_dtype=dtype, out_dtype=jnp.float32)
  bound = fp8_gemm_error_bound(op_a, op_b)                          # (m, n)
  if not d_row_major:
    bound = bound.T                                                  # the D array is D^T
  assert_within_bound(d, want, bound, f"{jnp.dtype(dtype).name} D")
