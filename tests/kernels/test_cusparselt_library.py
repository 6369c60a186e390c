"""Tests of s24jax.kernels.cusparselt (library.py: the FFI handlers' build and registration;
ops.py: the Gemm convention, `compress` / `spmm` and their jnp stand-in).

The stand-in is checked against NumPy products written from ops.py's column-major
convention (op(A) op(B), each array read as the docstring says); the shapes cuSPARSELt cannot
take and the device check against their documented errors; the library build (g++ against
jaxlib's FFI headers and the cuSPARSELt wheels, no GPU needed) by the symbols of the built
file; on a GPU (`gpu`), the real handlers against the stand-in. The sparse op's backend built
on these calls: tests/sparse_ops/test_cusparselt_backend.py.
"""
import subprocess

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from s24jax.kernels import masks
from s24jax.kernels.cusparselt import library
from s24jax.kernels.cusparselt import ops as cusparselt


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


@pytest.mark.parametrize("trans_a,trans_b", [(True, False), (False, False), (True, True),
                                             (False, True)])
def test_standin_follows_the_column_major_convention(trans_a, trans_b):
  """D = op(A) op(B) with each array read as the docstring says, against NumPy."""
  g = cusparselt.Gemm(m=32, n=48, k=64, trans_a=trans_a, trans_b=trans_b)
  a = np.asarray(_normal(0, g.a_shape()))
  b = np.asarray(_normal(1, g.b_shape()))
  op_a = a if trans_a else a.T          # (m, k)
  op_b = b if trans_b else b.T          # (k, n)
  want = (op_a @ op_b).T                # the D array: D^T, (n, m)
  with cusparselt.standin():
    c = cusparselt.compress(jnp.asarray(a), g, b_dtype=jnp.float32, d_dtype=jnp.float32)
    assert c.dtype == jnp.uint8 and c.shape == (a.size * 4,)
    d = cusparselt.spmm(c, jnp.asarray(b), g, a_dtype=jnp.float32, out_dtype=jnp.float32)
  assert d.shape == g.d_shape() == want.shape
  np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-5)


def test_shapes_it_cannot_take_name_the_dimension():
  g = cusparselt.Gemm(m=32, n=48, k=36, trans_a=True, trans_b=False)
  with cusparselt.standin(), pytest.raises(ValueError, match=r"k \(the contraction.*36"):
    cusparselt.compress(jnp.zeros(g.a_shape()), g, b_dtype=jnp.float32, d_dtype=jnp.float32)


def test_off_a_gpu_it_names_the_backend_that_runs():
  g = cusparselt.Gemm(m=32, n=48, k=64, trans_a=True, trans_b=False)
  with pytest.raises(cusparselt.UnsupportedDevice, match="sparsity.backend='xla'"):
    cusparselt.compress(jnp.zeros(g.a_shape()), g, b_dtype=jnp.float32, d_dtype=jnp.float32)


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
      out_dtype=jnp.float32))(a, b)
  with cusparselt.standin():
    want = cusparselt.spmm(cusparselt.compress(a, g, b_dtype=b.dtype, d_dtype=b.dtype), b, g,
                           a_dtype=a.dtype, out_dtype=jnp.float32)
  np.testing.assert_allclose(d, want, rtol=2e-2, atol=2e-2)
