"""PyTorch's cuSPARSELt on the same GEMMs: the field's own path, the peer the report measures
s24jax's FFI against (torch._cslt_compress and torch._cslt_sparse_mm; the GPU host's image
has torch 2.11.0). Optional: without torch, CUDA or those functions the GEMM rows say so.

torch's op: D (m, n) = A (m, k, row-major, 2:4 along k) @ B (k, n). s24jax's `Gemm`
(kernels/cusparselt/ops.py) is the same product, so a GEMM is given to torch with A as op(A),
row-major (torch's only layout for A; s24jax's dgrad passes it column-major in bf16), and B as
op(B) in the memory order s24jax passes (a transposed view where s24jax's B array is
op(B)^T). Operands are random, 2:4 along k, in the GEMM's types (FP8: D in float32).
"""
from __future__ import annotations

import statistics

import jax.numpy as jnp

from s24jax.kernels.cusparselt import ops as cusparselt

_TORCH_DTYPES = {"bf16": "bfloat16", "f16": "float16", "e4m3": "float8_e4m3fn",
                 "e5m2": "float8_e5m2", "f32": "float32"}


def unavailable() -> str | None:
  """Why torch's cuSPARSELt cannot run here, or None."""
  try:
    import torch  # pylint: disable=g-import-not-at-top  (optional peer)
  except ImportError as e:
    return f"torch is not importable ({e})"
  if not hasattr(torch, "_cslt_sparse_mm"):
    return f"torch {torch.__version__} has no torch._cslt_sparse_mm"
  if not torch.cuda.is_available():
    return f"torch {torch.__version__} sees no CUDA device"
  return None


def _dtype(torch, jax_dtype):
  return getattr(torch, _TORCH_DTYPES[cusparselt.dtype_name(jax_dtype)])


def times_ms(gemm: cusparselt.Gemm, a_dtype, d_dtype, *, calls: int, repeats: int) -> dict:
  """{'torch_sparse': ms per call on A compressed beforehand, 'torch_sparse+compress': with
  the compression in every call}, CUDA events around `calls` calls, median of `repeats`."""
  import torch  # pylint: disable=g-import-not-at-top  (optional peer)
  dev = torch.device("cuda")
  gen = torch.Generator(device=dev).manual_seed(0)
  dt = _dtype(torch, a_dtype)
  a = torch.randn(gemm.m, gemm.k, device=dev, generator=gen, dtype=torch.bfloat16)  # (m, k)
  a.view(gemm.m, gemm.k // 4, 4)[..., 2:] = 0        # 2:4 along k (which 2 does not matter)
  a = a.to(dt)
  if gemm.trans_b:
    b = torch.randn(gemm.k, gemm.n, device=dev, generator=gen, dtype=torch.bfloat16)  # (k, n)
  else:
    b = torch.randn(gemm.n, gemm.k, device=dev, generator=gen, dtype=torch.bfloat16).t()
  b = b.to(dt)
  kwargs = {} if jnp.dtype(d_dtype) == jnp.dtype(a_dtype) else {"out_dtype": _dtype(torch,
                                                                                     d_dtype)}
  compressed = torch._cslt_compress(a)   # pylint: disable=protected-access
  fns = {"torch_sparse": lambda: torch._cslt_sparse_mm(compressed, b, **kwargs),  # pylint: disable=protected-access
         "torch_sparse+compress": lambda: torch._cslt_sparse_mm(  # pylint: disable=protected-access
             torch._cslt_compress(a), b, **kwargs)}  # pylint: disable=protected-access
  out = {}
  for name, fn in fns.items():
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      for _ in range(calls):
        fn()
      end.record()
      end.synchronize()
      times.append(start.elapsed_time(end) / calls)
    out[name] = statistics.median(times)
  del a, b, compressed
  torch.cuda.empty_cache()
  return out
