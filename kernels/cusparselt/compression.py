"""Which compression serves a cuSPARSELt operand: s24jax's own (layout.py: jnp that XLA fuses
with the projection making the operand 2:4, one read and one write at memory speed) or the
library's `cusparseLtSpMMACompress` (ops.compress: a generic routine, 0.02-6 ms per operand on
an H200, 2026-11-27).

s24jax's serves an operand when
  1. the GEMM takes A as op(A) itself (TN, `Gemm.trans_a`: the only orientation layout.py
     writes; the backend asks for TN wherever s24jax's compression serves, so W~^T for the data
     gradient is written transposed from W~ in the same pass),
  2. layout.py has a layout for the target GPU, the element size and the shape, and
  3. on a GPU of this process, its bytes equal the library's for that shape: checked once per
     (device, layout, m, k, dtype), at first use, outside the step being traced, on a probe
     operand with exactly two non-zeros per group (so the positions are unambiguous). Where
     they differ (or the check fails), the library compresses that operand, said once in a
     warning. On a compile-only GPU (the planner) and under the CPU stand-in nothing can be
     compared and the layout is taken as it is (the stand-in writes the same layout).
Nothing here has run on a GPU yet: the check is the guard, and a `gpu` test compares every
layout with the library (tests/kernels/test_cusparselt_compression.py).
"""
from __future__ import annotations

import concurrent.futures
import functools
import threading

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from .. import _common
from . import layout
from . import ops

_LOCK = threading.Lock()
# (device kind, compute capability, layout, m, k, dtype) -> None (equal) or why not.
_VERDICTS: dict = {}


def forget() -> None:
  """Forgets this process's verdicts (as a new process would)."""
  with _LOCK:
    _VERDICTS.clear()


def _target_compute_capability() -> tuple[int, int] | None:
  """The compute capability whose layout is written: the stand-in's GPU under the stand-in,
  else the target device's (None off a GPU)."""
  if ops._STANDIN:   # pylint: disable=protected-access
    return ops.STANDIN_COMPUTE_CAPABILITY
  dev = _common.target_device()
  cc = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
  try:
    return tuple(int(p) for p in str(cc).split(".")[:2]) if cc else None
  except ValueError:
    return None


def _local_gpu(dev) -> bool:
  """Whether `dev` is a GPU of this process (not a compile-only one)."""
  if dev.platform != "gpu":
    return False
  try:
    return dev in jax.devices("gpu")
  except RuntimeError:
    return False


def s24jax_layout(gemm: ops.Gemm, a_dtype) -> layout.Layout | None:
  """The layout s24jax writes A of `gemm` in, or None where the library compresses (module
  docstring: 1-3; on a GPU the check of 3 runs here, once, at first use)."""
  if not gemm.trans_a:
    return None
  lay = layout.for_target(_target_compute_capability(), jnp.dtype(a_dtype).itemsize, gemm.m,
                          gemm.k)
  if lay is None or ops._STANDIN:   # pylint: disable=protected-access
    return lay
  dev = _common.target_device()
  if not _local_gpu(dev):
    return lay
  key = (dev.device_kind, dev.compute_capability, lay.name, gemm.m, gemm.k,
         jnp.dtype(a_dtype).name)
  with _LOCK:
    known = key in _VERDICTS
  if not known:
    verdict = _outside_trace(lambda: mismatch(gemm, a_dtype, lay))
    with _LOCK:
      _VERDICTS[key] = verdict
    if verdict is not None:
      logging.warning("cuSPARSELt: s24jax's compression (layout %s) does not write what the "
                   "library does for a (%d, %d) %s operand on a %s (%s); the library "
                   "compresses it instead (slower).", lay.name, gemm.m, gemm.k,
                   jnp.dtype(a_dtype).name, dev.device_kind, verdict)
  return lay if _VERDICTS[key] is None else None


def compress(a: jax.Array, gemm: ops.Gemm, *, b_dtype, d_dtype) -> jax.Array:
  """A of `gemm` (gemm.a_shape()), 2:4 along k, compressed for cuSPARSELt: by s24jax where its
  layout serves (module docstring), else by the library. The same bytes either way."""
  lay = s24jax_layout(gemm, a.dtype)
  if lay is None:
    return ops.compress(a, gemm, b_dtype=b_dtype, d_dtype=d_dtype)
  if tuple(a.shape) != gemm.a_shape():
    raise ValueError(f"cusparselt compress: A has shape {tuple(a.shape)}, the GEMM "
                     f"{gemm} needs {gemm.a_shape()}")
  gemm.check("compress", a_dtype=a.dtype, b_dtype=b_dtype, d_dtype=d_dtype)
  with jax.named_scope("cusparselt_s24jax_compress"):   # the step census finds it by name
    return layout.compress(a, lay)


def probe_operand(m: int, k: int, dtype, seed: int = 0) -> jax.Array:
  """op(A) (m, k) with exactly two non-zeros per group of four, at random positions, of
  magnitudes in [1, 2) (no FP8 underflow) with random signs; made on the device (jitted: the
  steps' operands reach hundreds of millions of values)."""
  return _probe(m, k, jnp.dtype(dtype), seed)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _probe(m: int, k: int, dtype, seed: int) -> jax.Array:
  kr, km, ks = jax.random.split(jax.random.key(seed), 3)
  rank = [jax.random.uniform(r, (m, k // 4)) for r in jax.random.split(kr, 4)]
  keep = _common.top2_of4(rank)                                      # 4 x (m, k/4): 2 kept
  mags = 1.0 + jax.random.uniform(km, (m, k // 4, 4))
  signs = jnp.where(jax.random.bernoulli(ks, 0.5, (m, k // 4, 4)), -1.0, 1.0)
  values = jnp.where(jnp.stack(keep, -1), mags * signs, 0.0)         # (m, k/4, 4)
  return values.reshape(m, k).astype(dtype)


def mismatch(gemm: ops.Gemm, a_dtype, lay: layout.Layout) -> str | None:
  """None if s24jax's bytes for a probe operand of `gemm`'s A equal the library's on this GPU,
  else where they first differ (or the library's error)."""
  op_a = probe_operand(gemm.m, gemm.k, a_dtype)
  b_dtype = a_dtype
  d_dtype = jnp.float32 if jnp.dtype(a_dtype).itemsize == 1 else a_dtype
  try:
    ours = np.asarray(jax.jit(lambda x: layout.compress(x, lay))(op_a))
    theirs = np.asarray(jax.jit(lambda x: ops.compress(x, gemm, b_dtype=b_dtype,
                                                       d_dtype=d_dtype))(op_a))
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  return describe_difference(ours, theirs, gemm.m, gemm.k, jnp.dtype(a_dtype).itemsize)


def describe_difference(ours: np.ndarray, theirs: np.ndarray, m: int, k: int,
                        itemsize: int) -> str | None:
  """None if equal, else the count of differing bytes in each section and the first one."""
  if ours.shape != theirs.shape:
    return f"{ours.size} bytes against the library's {theirs.size}"
  diff = np.flatnonzero(ours != theirs)
  if not diff.size:
    return None
  n_values = m * k * itemsize // 2
  in_values = int((diff < n_values).sum())
  first = int(diff[0])
  where = (f"value byte {first}" if first < n_values else
           f"metadata byte {first - n_values}")
  return (f"{in_values} value and {diff.size - in_values} metadata bytes differ; the first, "
          f"{where}: {int(ours[first]):#04x} against {int(theirs[first]):#04x}")


def _outside_trace(fn):
  """fn() in a fresh thread, so that its jitted calls run rather than join the trace of the
  step being built (JAX keeps traces per thread)."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(fn).result()
