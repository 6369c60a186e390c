"""Tests of s24jax.kernels.cusparselt (library.py: the FFI handlers' build and registration,
which libcusparseLt serves them, the pinned version; ops.py: the Gemm convention,
`compress` / `spmm` and their jnp stand-in).

The stand-in is checked against NumPy products written from ops.py's column-major
convention (op(A) op(B), each array read as the docstring says); the shapes cuSPARSELt cannot
take and the device check against their documented errors; the library build (g++ against
jaxlib's FFI headers and the cuSPARSELt wheels, no GPU needed) by the symbols of the built
file; the handlers' bindings by calling them on the CPU, where decoding stops only at the
missing GPU stream; which library serves, against the wheel's header and file; on a GPU
(`gpu`), the real handlers against the stand-in. The sparse op's backend built on these calls:
tests/sparse_ops/test_cusparselt_backend.py. The handlers' scratch under XLA's FFI contract:
tests/kernels/test_cusparselt_scratch.py. The algorithms: test_cusparselt_algorithms.py.

FP8 on a GPU: the library's tensor cores accumulate with 14 significant bits and truncate, so
the FP8 handlers are compared with the exact product within `fp8_gemm_error_bound`
(kernels/_testing.py, derived from that arithmetic); a CPU test checks that bound against a
model of the accumulation and against the mistakes it must still catch.
"""
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

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
from s24jax.kernels.cusparselt import algorithms
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
  """The stand-in's buffer holds a real 2:4 compression (kernels/cusparselt/layout.py): a 2:4
  operand comes back exactly (bf16, e4m3; read back as A I, a GEMM with the identity), and a
  dense one keeps only the two lowest-indexed entries of each group of 4 (layout.py's rule for
  an operand that is not 2:4: what the library does with one is not documented)."""
  g = cusparselt.Gemm(m=32, n=64, k=64, trans_a=True, trans_b=False)   # D^T = (A I)^T

  def round_trip(a, dtype, d_dtype):
    with cusparselt.standin():
      c = cusparselt.compress(a, g, b_dtype=dtype, d_dtype=d_dtype)
      d = cusparselt.spmm(c, jnp.eye(g.k, dtype=dtype), g, a_dtype=dtype, out_dtype=d_dtype)
    return np.asarray(d, np.float32).T                           # (m, k)

  for dtype, d_dtype in ((jnp.bfloat16, jnp.bfloat16), (jnp.float8_e4m3fn, jnp.float32)):
    a = _sparse(2, g.a_shape(), dtype)
    np.testing.assert_array_equal(round_trip(a, dtype, d_dtype), np.asarray(a, np.float32))
  dense = np.asarray(_normal(3, g.a_shape()).astype(jnp.bfloat16), np.float32)
  assert (dense != 0).all()
  want = np.where(np.arange(g.k) % 4 < 2, dense, 0)              # positions 0 and 1 kept
  np.testing.assert_array_equal(round_trip(jnp.asarray(dense, jnp.bfloat16), jnp.bfloat16,
                                           jnp.bfloat16), want)


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


def _toolchain_or_skip():
  try:
    return library.toolchain()
  except library.Unavailable as e:
    assert library.INSTALL_HINT in str(e)
    pytest.skip(f"cuSPARSELt wheels not installed: {e}")


@pytest.mark.slow   # g++ builds the handlers (a subprocess)
def test_the_library_builds_and_registers_without_a_gpu(tmp_path, monkeypatch):
  """The real handlers: compiled with g++ against jaxlib's FFI headers and the wheels, cached
  by version, registered for CUDA: the three targets (compress, spmm, search) and the plain C
  function that names the serving library. Skipped, saying why, without the wheels."""
  tools = _toolchain_or_skip()
  monkeypatch.setenv("S24JAX_CACHE", str(tmp_path))
  path = library.build()
  assert path.exists() and path.parent == tmp_path / "cusparselt"
  assert f"cusparselt{tools.cusparselt_version}" in path.name and jaxlib.__version__ in path.name
  mtime = path.stat().st_mtime
  assert library.build() == path and path.stat().st_mtime == mtime   # cached, not rebuilt
  symbols = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True,
                           text=True).stdout.split()
  assert sorted(library.TARGETS) == ["cusparselt_compress", "cusparselt_search",
                                     "cusparselt_spmm"]
  assert all(target.startswith(library.PREFIX) for target in library.TARGETS)
  for symbol in (*library.TARGETS.values(), library.SERVING_SYMBOL):
    assert symbol in symbols, symbol
  library.register.cache_clear()
  library.register()


def test_a_missing_wheel_or_compiler_is_one_clear_error(monkeypatch):
  monkeypatch.setattr(library.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(library.Unavailable, match=r"pip install -r requirements-gpu.txt"):
    library.toolchain()


# ---------------------------------------------------------------------------------------------
# Which libcusparseLt serves, and the pinned version.

_SERVING = """
import json
from s24jax.kernels.cusparselt import library
serving = library.serving()
print(json.dumps({"serving": serving, "mapped": library.mapped_files()}))
"""


def _wheel_file_and_header_version() -> tuple[str, str]:
  """The wheel's libcusparseLt file and its header's CUSPARSELT_VER_* version, found here
  from the installed nvidia package (not through library.py)."""
  spec = importlib.util.find_spec("nvidia")
  for folder in spec.submodule_search_locations if spec else []:
    lib = pathlib.Path(folder, "cu13", "lib", "libcusparseLt.so.0")
    header = pathlib.Path(folder, "cu13", "include", "cusparseLt.h")
    if lib.exists() and header.exists():
      parts = [re.search(rf"#define CUSPARSELT_VER_{p}\s+(\d+)", header.read_text()).group(1)
               for p in ("MAJOR", "MINOR", "PATCH")]
      return os.path.realpath(lib), ".".join(parts)
  pytest.skip("the nvidia-cusparselt-cu13 wheel is not installed")


def test_serving_names_the_wheels_library_and_version_without_a_gpu():
  """In a fresh process that loads no other cuSPARSELt, with every GPU hidden: the handler
  library's own answer (cusparseLtGetProperty and dladdr) is the wheel's file and the
  version its header states, and that file is the one libcusparseLt mapped."""
  _toolchain_or_skip()
  wheel_file, header_version = _wheel_file_and_header_version()
  run = subprocess.run([sys.executable, "-c", _SERVING], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert out["serving"] == {"path": wheel_file, "version": header_version}
  assert [os.path.realpath(p) for p in out["mapped"]] == [wheel_file]


def test_files_in_maps_reads_a_maps_text():
  """Paths with spaces, deleted files, duplicates (one mapping per segment), other libraries
  whose names only begin alike, anonymous and special mappings."""
  maps = "\n".join([
      "7f00-7f01 r--p 00000000 08:01 101   /opt/a b/libcusparseLt.so.0",
      "7f01-7f02 r-xp 00001000 08:01 101   /opt/a b/libcusparseLt.so.0",
      "7f02-7f03 r--p 00000000 08:01 102   /usr/lib/libcusparse.so.12",
      "7f03-7f04 r--p 00000000 08:01 103   /tmp/old/libcusparseLt.so.0.8 (deleted)",
      "7f04-7f05 rw-p 00000000 00:00 0 ",
      "7f05-7f06 rw-p 00000000 00:00 0   [heap]",
      "7f06-7f07 r--p 00000000 08:01 104   /site/torch/lib/libcusparseLt-f8b4a9fb.so.0",
  ])
  assert library.files_in_maps(maps, "libcusparseLt") == [
      "/opt/a b/libcusparseLt.so.0", "/site/torch/lib/libcusparseLt-f8b4a9fb.so.0",
      "/tmp/old/libcusparseLt.so.0.8"]
  assert library.files_in_maps(maps, "libnothing") == []


def test_pinned_version_reads_the_requirements_pin(tmp_path):
  good = tmp_path / "good.txt"
  good.write_text("# cuSPARSELt\n# nvidia-cusparselt-cu13==0.1.0 (old)\nnumpy>=1\n"
                  "nvidia_cusparselt_cu13 == 0.11.2 ; sys_platform == 'linux'\n")
  assert library.pinned_version(good) == "0.11.2"
  two = tmp_path / "two.txt"
  two.write_text("nvidia-cusparselt-cu13==0.10.0\nnvidia-cusparselt-cu13==0.11.0\n")
  none = tmp_path / "none.txt"
  none.write_text("nvidia-cusparselt-cu12==0.10.0\nnvidia-cusparselt-cu13>=0.10\n")
  for path, why in ((two, r"pins \['0.10.0', '0.11.0'\]"), (none, "has no such pin"),
                    (tmp_path / "missing.txt", "cannot read")):
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: .*{why}") as e:
      library.pinned_version(path)
    assert "nvidia-cusparselt-cu13==X.Y.Z" in str(e.value) and "\n" not in str(e.value)
  # The repository's own pin is the installed wheel's version (CI installs the pin).
  try:
    installed = importlib.metadata.version("nvidia-cusparselt-cu13")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("the nvidia-cusparselt-cu13 wheel is not installed")
  assert library.pinned_version() == installed


# ---------------------------------------------------------------------------------------------
# The handlers' bindings, on the CPU: XLA decodes a handler's operands, results, attributes
# and context before it runs it, and reports every mismatch at once. Registered for the host
# too (under other names), the CUDA handlers fail there only at XLA's GPU stream, which the
# CPU lacks, when the call carries exactly the attributes and types they bind.

_HOST = "s24jax_test_host_"


@pytest.fixture(scope="module")
def host_targets():
  """The handlers registered for the CPU as _HOST + target."""
  _toolchain_or_skip()
  handlers = ctypes.CDLL(str(library.register()))
  for target, symbol in library.TARGETS.items():
    jax.ffi.register_ffi_target(_HOST + target, jax.ffi.pycapsule(getattr(handlers, symbol)),
                                platform="cpu")


def _decode_errors(monkeypatch, call) -> list[str]:
  """The errors of `call` (ops / algorithms code) run on the CPU with its FFI calls sent to
  the host registrations."""
  ffi_call = jax.ffi.ffi_call
  monkeypatch.setattr(jax.ffi, "ffi_call", lambda target, *a, **k: ffi_call(_HOST + target,
                                                                             *a, **k))
  monkeypatch.setattr(cusparselt, "check_device", lambda *a, **k: None)
  errors = []
  for fn in call:
    with pytest.raises(Exception) as e:   # pylint: disable=broad-exception-caught
      jax.block_until_ready(fn())
    errors.append(str(e.value))
  return errors


def _only_the_stream_failed(error: str) -> bool:
  return ("stream" in error.lower() and
          not re.search(r"attribute|mismatch|wrong|expected", error, re.I))


def test_the_handlers_bind_what_ops_and_algorithms_pass(host_targets, monkeypatch):
  """compress, spmm under an algorithm and the search, as the library code calls them: only
  XLA's GPU stream is missing. The same check flags a call that drops an attribute or gives
  the search's result the wrong type."""
  del host_targets
  g = cusparselt.Gemm(m=32, n=16, k=64, trans_a=True, trans_b=False)
  a = jnp.zeros(g.a_shape(), jnp.float8_e4m3fn)
  b = jnp.zeros(g.b_shape(), jnp.float8_e4m3fn)
  c = jnp.zeros((g.compressed_bytes(a.dtype),), jnp.uint8)
  kw = dict(a_dtype=a.dtype, out_dtype=jnp.float32)
  errors = _decode_errors(monkeypatch, [
      lambda: cusparselt.compress(a, g, b_dtype=b.dtype, d_dtype=jnp.float32),
      lambda: cusparselt.spmm(c, b, g, **kw, alg=algorithms.Algorithm(3, 2, 1, 4)),
      lambda: cusparselt.spmm(c, b, g, **kw),
      lambda: algorithms.search_call(c, b, g, **kw)])
  assert all(_only_the_stream_failed(e) for e in errors), errors
  wrong = _decode_errors(monkeypatch, [
      lambda: jax.ffi.ffi_call("cusparselt_spmm", jax.ShapeDtypeStruct(g.d_shape(), jnp.float32))(
          c, b, **g.attrs(), a_dtype="e4m3", alg_id=np.int64(-1)),
      lambda: jax.ffi.ffi_call("cusparselt_search", jax.ShapeDtypeStruct((5,), jnp.float32))(
          c, b, **g.attrs(), a_dtype="e4m3", d_dtype="f32")])
  assert not any(_only_the_stream_failed(e) for e in wrong), wrong


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
