"""The JAX side of the cuSPARSELt backend: `compress` and `spmm` as FFI calls.

The GEMM convention (cusparselt_ffi.cc describes every matrix column-major, so JAX's row-major
arrays are passed as they are). A row-major array of shape (C, R) is the column-major R x C
matrix X with the array equal to X^T. With `Gemm(m, n, k, trans_a, trans_b)`:

    D (m x n) = op(A) (m x k) @ op(B) (k x n),   op(A) 2:4 along k
    the A array is op(A) itself, shape (m, k), if trans_a; else op(A)^T, shape (k, m)
    the B array is op(B) itself, shape (k, n), if trans_b; else op(B)^T, shape (n, k)
    the D array is D^T, shape (n, m)  (d_row_major: D, shape (m, n))

`compress(a, gemm)` turns the dense 2:4 A array into cuSPARSELt's opaque compressed form
(the library's `cusparseLtSpMMACompress2`: by A's descriptor, independent of the algorithm
that multiplies; compression.py decides where s24jax writes it instead), as a uint8 buffer of
the bound rules.py gives (9/16 of A's bytes for 16-bit types, 10/16 for 8-bit: half the values
and 2 bits per kept value; the handler checks the library's own size against it);
`spmm(a_compressed, b, gemm, ..., alg=)` multiplies, under a given algorithm (algorithms.py)
or the library's default. Both are `jax.ffi.ffi_call`s of the targets
that library.register() builds and registers. Every GEMM is checked against the library's
rules first (rules.py: types, layouts, dimensions), so one it would refuse fails at trace
time, on any machine, with an error naming the rule.

The stand-in: `with standin():` replaces both calls by jnp with the same operands, shapes,
transposes and layouts, under the same rules. Its compressed buffer is the one layout.py writes
for an H100 (STANDIN_COMPUTE_CAPABILITY; the stand-in's own natural order off the layout's
tiles), so every CPU test of the backend also compresses and multiplies through that layout,
and an operand that is not 2:4 along k loses values as it would on the GPU. It is
the one place a test replaces the library, so the CPU suite can check everything around the
FFI calls (the operands and layouts s24jax.sparse_ops passes, the gradients, the training)
against the xla backend; the handlers themselves run only on a GPU (tests marked `gpu`).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from .. import _common
from . import layout
from . import library
from . import rules

if TYPE_CHECKING:   # algorithms.py imports this module
  from . import algorithms

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

  def check(self, what: str, *, a_dtype, b_dtype, d_dtype) -> None:
    """A GEMM cuSPARSELt 0.10 would refuse is refused here (rules.RuleError, naming the rule)."""
    try:
      rules.check(what, m=self.m, n=self.n, k=self.k, trans_a=self.trans_a,
                  trans_b=self.trans_b, a_type=dtype_name(a_dtype),
                  b_type=dtype_name(b_dtype),
                  d_type=dtype_name(d_dtype))
    except rules.RuleError as e:
      raise rules.RuleError(f"{e} The sparse operand has shape {self.a_shape()}. Use "
                            f"sparsity.backend='{BACKEND_ELSEWHERE}' for this layer.") from None

  def compressed_bytes(self, a_dtype) -> int:
    """The compressed A buffer's size (rules.py, R9)."""
    return rules.rule(dtype_name(a_dtype)).compressed_bytes(self.m * self.k)


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


def check_device(a_dtype=jnp.bfloat16) -> None:
  """Raises UnsupportedDevice unless the target is an NVIDIA GPU whose compute capability runs
  2:4 GEMMs of `a_dtype` (rules.py, R8: 8.0+; e4m3 / e5m2 from 8.9: L4, L40S, H100 and newer).
  The target is the default device: a compile-only GPU in a deviceless compile, else jax's
  first."""
  if _STANDIN:
    return
  dev = _common.target_device()
  cc = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
  try:
    major_minor = tuple(int(p) for p in str(cc).split(".")[:2])
  except ValueError:
    major_minor = None
  if cc is None or major_minor is None or major_minor < rules.MIN_COMPUTE_CAPABILITY:
    where = (f"a {dev.device_kind} (compute capability {cc})" if dev.platform == "gpu"
             else f"jax platform {dev.platform!r}")
    raise UnsupportedDevice(
        "sparsity.backend='cusparselt' runs on NVIDIA GPUs with 2:4 sparse tensor cores "
        f"(compute capability 8.0+: A100, H100 and newer); this process targets {where}. "
        f"Use sparsity.backend='{BACKEND_ELSEWHERE}', which runs on every device.")
  why = rules.check_compute_capability(dtype_name(a_dtype), major_minor, dev.device_kind)
  if why:
    raise UnsupportedDevice(f"{why}. Set sparsity.fp8=False, or use "
                            f"sparsity.backend='{BACKEND_ELSEWHERE}'.")


def dtype_name(dtype) -> str:
  try:
    return _DTYPE_NAMES[jnp.dtype(dtype)]
  except KeyError:
    raise ValueError(f"cusparselt: unsupported dtype {jnp.dtype(dtype)}; valid: "
                     f"{', '.join(_DTYPE_NAMES.values())}") from None


def compress(a: jax.Array, gemm: Gemm, *, b_dtype, d_dtype) -> jax.Array:
  """cuSPARSELt's compressed form of the dense 2:4 A array (shape gemm.a_shape()) for `gemm`
  with B in `b_dtype` and D in `d_dtype`: uint8 (gemm.compressed_bytes(A's dtype),). The
  form depends on A alone (its shape, dtype and gemm.trans_a), not on the algorithm, so one
  compression serves spmm under any `alg`; the B and D dtypes are checked against the
  library's rules and carried in the call, so that the HLO names the whole GEMM."""
  if tuple(a.shape) != gemm.a_shape():
    raise ValueError(f"cusparselt compress: A has shape {tuple(a.shape)}, the GEMM "
                     f"{gemm} needs {gemm.a_shape()}")
  if not _STANDIN:   # off a GPU, that is the first thing to say
    check_device(a.dtype)
  gemm.check("compress", a_dtype=a.dtype, b_dtype=b_dtype, d_dtype=d_dtype)
  nbytes = gemm.compressed_bytes(a.dtype)
  if _STANDIN:
    return _standin_compress(a, gemm, nbytes)
  library.register()
  # vmap (scanned blocks' stacked weights): one call per layer.
  call = jax.ffi.ffi_call("cusparselt_compress", jax.ShapeDtypeStruct((nbytes,), jnp.uint8),
                          vmap_method="sequential")
  return call(a, **gemm.attrs(), b_dtype=dtype_name(b_dtype), d_dtype=dtype_name(d_dtype))


def spmm(a_compressed: jax.Array, b: jax.Array, gemm: Gemm, *, a_dtype, out_dtype,
         alg: algorithms.Algorithm | None = None) -> jax.Array:
  """D = op(A) op(B) (module docstring) from `compress`'s output; the D array, shape
  gemm.d_shape(), in `out_dtype` (float32 accumulation). `alg` is the library's algorithm
  for it (kernels/cusparselt/algorithms.py: `search` finds one); None: the library's default
  selection. The stand-in ignores `alg` (it has one arithmetic)."""
  if tuple(b.shape) != gemm.b_shape():
    raise ValueError(f"cusparselt spmm: B has shape {tuple(b.shape)}, the GEMM {gemm} "
                     f"needs {gemm.b_shape()}")
  if not _STANDIN:
    check_device(a_dtype)
  gemm.check("spmm", a_dtype=a_dtype, b_dtype=b.dtype, d_dtype=out_dtype)
  if a_compressed.shape != (gemm.compressed_bytes(a_dtype),):
    raise ValueError(f"cusparselt spmm: the compressed A has shape {a_compressed.shape}, the "
                     f"GEMM {gemm} in {jnp.dtype(a_dtype)} needs "
                     f"({gemm.compressed_bytes(a_dtype)},)")
  if _STANDIN:
    op_a = _standin_decompress(a_compressed, gemm, a_dtype)            # (m, k)
    op_b = b if gemm.trans_b else b.T                                  # (k, n)
    # float32 products of the operands are exact (XLA:CPU has no bf16 x bf16 -> f32 dot
    # inside a fused step), summed in float32 as the library does.
    d = jnp.matmul(op_a.astype(jnp.float32), op_b.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)                # (m, n)
    return (d if gemm.d_row_major else d.T).astype(out_dtype)
  library.register()
  call = jax.ffi.ffi_call("cusparselt_spmm", jax.ShapeDtypeStruct(gemm.d_shape(), out_dtype),
                          vmap_method="sequential")
  # algorithms.py imports this module, so the algorithm comes as its attrs(), not its class.
  alg_attrs = library.ALGORITHM_DEFAULTS if alg is None else alg.attrs()
  return call(a_compressed, b, **gemm.attrs(), a_dtype=dtype_name(a_dtype),
              **{name: np.int64(value) for name, value in alg_attrs.items()})


# ---------------------------------------------------------------------------------------------
# The stand-in's compressed format: layout.py's, the one s24jax writes for the library.

# The GPU whose layout the stand-in writes: the H100 / H200 the backend is tuned for.
STANDIN_COMPUTE_CAPABILITY = (9, 0)


def standin_layout(gemm: Gemm, a_dtype) -> layout.Layout:
  """The layout the stand-in compresses op(A) in: layout.py's for STANDIN_COMPUTE_CAPABILITY
  where the operand is on its tiles, else its own natural order."""
  return (layout.for_target(STANDIN_COMPUTE_CAPABILITY, jnp.dtype(a_dtype).itemsize, gemm.m,
                            gemm.k) or layout.NATURAL)


def _standin_compress(a: jax.Array, gemm: Gemm, nbytes: int) -> jax.Array:
  """op(A) (m, k) compressed as layout.py writes it: exactly `nbytes` (rules.py, R9)."""
  op_a = a if gemm.trans_a else a.T                                  # (m, k), groups along k
  out = layout.compress(op_a, standin_layout(gemm, a.dtype))
  assert out.size == nbytes, (out.size, nbytes)
  return out


def _standin_decompress(c: jax.Array, gemm: Gemm, a_dtype) -> jax.Array:
  """The inverse of `_standin_compress`: op(A) (m, k) in `a_dtype`."""
  return layout.decompress(c, gemm.m, gemm.k, a_dtype, standin_layout(gemm, a_dtype))
