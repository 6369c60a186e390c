"""The JAX side of the cuSPARSELt backend: `compress` and `spmm` as FFI calls.

The GEMM convention (cusparselt_ffi.cc describes every matrix column-major, so JAX's row-major
arrays are passed as they are). A row-major array of shape (C, R) is the column-major R x C
matrix X with the array equal to X^T. With `Gemm(m, n, k, trans_a, trans_b)`:

    D (m x n) = op(A) (m x k) @ op(B) (k x n),   op(A) 2:4 along k
    the A array is op(A) itself, shape (m, k), if trans_a; else op(A)^T, shape (k, m)
    the B array is op(B) itself, shape (k, n), if trans_b; else op(B)^T, shape (n, k)
    the D array is D^T, shape (n, m)  (d_row_major: D, shape (m, n))

`compress(a, gemm)` turns the dense 2:4 A array into cuSPARSELt's opaque compressed form,
under the plan of that GEMM (the layout depends on the plan's algorithm), as a uint8 buffer of
A's byte size (an upper bound of the compressed size that needs no GPU to compute);
`spmm(a_compressed, b, gemm, ...)` multiplies. Both are `jax.ffi.ffi_call`s of the targets
that library.register() builds and registers.

The stand-in: `with standin():` replaces both calls by jnp with the same operands, shapes,
transposes and layouts (the "compressed" buffer holds A's bytes). It is the one place a test
replaces the library, so the CPU suite can check everything around the FFI calls (the
operands and layouts s24jax.sparse_ops passes, the gradients, the training) against the xla
backend; the handlers themselves run only on a GPU (tests marked `gpu`).
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import library

MIN_COMPUTE_CAPABILITY = (8, 0)   # bf16 / f16 2:4 on sm_80+; e4m3 / e5m2 on sm_90+
BACKEND_ELSEWHERE = "xla"
_DTYPE_NAMES = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "f16",
                jnp.dtype(jnp.float8_e4m3fn): "e4m3", jnp.dtype(jnp.float8_e5m2): "e5m2",
                jnp.dtype(jnp.float32): "f32"}


class UnsupportedDevice(RuntimeError):
  """The cuSPARSELt backend was asked to run where no 2:4 sparse tensor core is."""


@dataclasses.dataclass(frozen=True)
class Gemm:
  """D (m x n) = op(A) (m x k) op(B) (k x n), op(A) 2:4 along k (module docstring)."""
  m: int
  n: int
  k: int
  trans_a: bool
  trans_b: bool
  d_row_major: bool = False

  def a_shape(self) -> tuple[int, int]:
    return (self.m, self.k) if self.trans_a else (self.k, self.m)

  def b_shape(self) -> tuple[int, int]:
    return (self.k, self.n) if self.trans_b else (self.n, self.k)

  def d_shape(self) -> tuple[int, int]:
    return (self.m, self.n) if self.d_row_major else (self.n, self.m)

  def attrs(self) -> dict:
    return dict(m=np.int64(self.m), n=np.int64(self.n), k=np.int64(self.k),
                trans_a=self.trans_a, trans_b=self.trans_b, d_row_major=self.d_row_major)

  def check(self, what: str, a_shape: tuple[int, ...]) -> None:
    """Shapes cuSPARSELt cannot take are refused here, naming the dimension."""
    for name, value, multiple in (("k (the contraction, 2:4 groups along it)", self.k, 16),
                                  ("m", self.m, 16), ("n", self.n, 16)):
      if value % multiple:
        raise ValueError(f"cusparselt {what}: {name} = {value} must be a multiple of "
                         f"{multiple} (cuSPARSELt's 16-byte alignment and 2:4 tiles); the "
                         f"sparse operand has shape {tuple(a_shape)}. Use "
                         f"sparsity.backend='{BACKEND_ELSEWHERE}' for this layer's shape.")


_STANDIN = False


@contextlib.contextmanager
def standin():
  """Replaces the FFI calls by jnp (module docstring) while tracing inside this block."""
  global _STANDIN
  old, _STANDIN = _STANDIN, True
  try:
    yield
  finally:
    _STANDIN = old


def check_device(*, fp8: bool = False) -> None:
  """Raises UnsupportedDevice unless the target is an NVIDIA GPU of compute capability 8.0+
  (9.0+ for FP8 operands; the default device: a compile-only GPU in a deviceless compile,
  else jax's first)."""
  if _STANDIN:
    return
  dev = jax.config.jax_default_device or jax.devices()[0]
  if not isinstance(dev, jax.Device):   # a platform name
    dev = jax.devices(dev)[0]
  cc = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
  try:
    major_minor = tuple(int(p) for p in str(cc).split(".")[:2])
  except ValueError:
    major_minor = None
  if cc is None or major_minor is None or major_minor < MIN_COMPUTE_CAPABILITY:
    where = (f"a {dev.device_kind} (compute capability {cc})" if dev.platform == "gpu"
             else f"jax platform {dev.platform!r}")
    raise UnsupportedDevice(
        "sparsity.backend='cusparselt' runs on NVIDIA GPUs with 2:4 sparse tensor cores "
        f"(compute capability 8.0+: A100, H100 and newer); this process targets {where}. "
        f"Use sparsity.backend='{BACKEND_ELSEWHERE}', which runs on every device.")
  if fp8 and major_minor < (9, 0):
    raise UnsupportedDevice(
        f"sparsity.fp8 with sparsity.backend='cusparselt' needs FP8 sparse tensor cores "
        f"(compute capability 9.0+: H100 and newer); this process targets a "
        f"{dev.device_kind} (compute capability {cc}). Set sparsity.fp8=False, or use "
        f"sparsity.backend='{BACKEND_ELSEWHERE}'.")


def _name(dtype) -> str:
  try:
    return _DTYPE_NAMES[jnp.dtype(dtype)]
  except KeyError:
    raise ValueError(f"cusparselt: unsupported dtype {jnp.dtype(dtype)}; valid: "
                     f"{', '.join(_DTYPE_NAMES.values())}") from None


def compress(a: jax.Array, gemm: Gemm, *, b_dtype, d_dtype) -> jax.Array:
  """cuSPARSELt's compressed form of the dense 2:4 A array (shape gemm.a_shape()) for `gemm`
  with B in `b_dtype` and D in `d_dtype`: uint8 (A's bytes,)."""
  if tuple(a.shape) != gemm.a_shape():
    raise ValueError(f"cusparselt compress: A has shape {tuple(a.shape)}, the GEMM "
                     f"{gemm} needs {gemm.a_shape()}")
  gemm.check("compress", a.shape)
  nbytes = a.size * a.dtype.itemsize
  if _STANDIN:
    return jax.lax.bitcast_convert_type(a.reshape(-1), jnp.uint8).reshape(nbytes)
  check_device(fp8=jnp.dtype(a.dtype).itemsize == 1)
  library.register()
  # vmap (scanned blocks' stacked weights): one call per layer.
  call = jax.ffi.ffi_call("cusparselt_compress", jax.ShapeDtypeStruct((nbytes,), jnp.uint8),
                          vmap_method="sequential")
  return call(a, **gemm.attrs(), b_dtype=_name(b_dtype), d_dtype=_name(d_dtype))


def spmm(a_compressed: jax.Array, b: jax.Array, gemm: Gemm, *, a_dtype, out_dtype) -> jax.Array:
  """D = op(A) op(B) (module docstring) from `compress`'s output; the D array, shape
  gemm.d_shape(), in `out_dtype` (float32 accumulation)."""
  if tuple(b.shape) != gemm.b_shape():
    raise ValueError(f"cusparselt spmm: B has shape {tuple(b.shape)}, the GEMM {gemm} "
                     f"needs {gemm.b_shape()}")
  gemm.check("spmm", gemm.a_shape())
  if _STANDIN:
    a = jax.lax.bitcast_convert_type(
        a_compressed.reshape(-1, jnp.dtype(a_dtype).itemsize), a_dtype).reshape(gemm.a_shape())
    op_a = a if gemm.trans_a else a.T                                  # (m, k)
    op_b = b if gemm.trans_b else b.T                                  # (k, n)
    d = jnp.matmul(op_a, op_b, preferred_element_type=jnp.float32)     # (m, n)
    return (d if gemm.d_row_major else d.T).astype(out_dtype)
  check_device()
  library.register()
  call = jax.ffi.ffi_call("cusparselt_spmm", jax.ShapeDtypeStruct(gemm.d_shape(), out_dtype),
                          vmap_method="sequential")
  return call(a_compressed, b, **gemm.attrs(), a_dtype=_name(a_dtype))
