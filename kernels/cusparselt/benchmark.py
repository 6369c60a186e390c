"""The cuSPARSELt rows of `python -m s24jax.kernels.bench --backend cusparselt`: each of the
sparse linear op's three GEMMs through cuSPARSELt (compression included, and without it for
the weight GEMMs, whose compression happens once per forward) against the dense cuBLAS GEMM
XLA runs for the same product, at GPT-2's FFN shapes, in bf16 (the layouts the sparse op uses
for 16-bit types: TN, NN, TT with a row-major D; kernels/cusparselt/rules.py). The FP8 GEMMs and
their accuracy against 'xla': `python -m s24jax.perf.gpu_report`. GPU only (A100 / H100); never run
here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import masks
from .. import bench_harness
from . import ops

# (name, GEMM of (t, n, k) with x (t, k), W~ (n, k), dY (t, n), which array is sparse,
#  the dense XLA product it replaces)
_GEMMS = {
    "forward y=xW~^T": (lambda t, n, k: ops.Gemm(m=n, n=t, k=k, trans_a=True, trans_b=False),
                        "w", lambda x, w, dy: x @ w.T),
    "dgrad dX=dYW~": (lambda t, n, k: ops.Gemm(m=k, n=t, k=n, trans_a=False, trans_b=False),
                      "w_t", lambda x, w, dy: dy @ w),
    "wgrad dW=MVUE(dY)^Tx": (lambda t, n, k: ops.Gemm(m=n, n=k, k=t, trans_a=True,
                                                      trans_b=True, d_row_major=True),
                             "dy_t", lambda x, w, dy: dy.T @ x),
}


def _operands(t, n, k, dtype):
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (t, k), dtype)
  w = jax.random.normal(kw, (n, k), dtype)
  dy = jax.random.normal(kd, (t, n), dtype)
  return x, jnp.where(masks.transposable_mask(w), w, 0), dy


def _rows(shapes, dtype, interpret, reps):
  del interpret   # the library runs on a GPU or not at all
  try:
    ops.check_device()
    ops.library.register()
  except (ops.UnsupportedDevice, ops.library.Unavailable) as e:
    yield dict(kernel="cusparselt", shape="-", note=f"skipped: {str(e)[:80]}")
    return
  for t, n, k in shapes:
    x, w, dy = _operands(t, n, k, dtype)
    sparse = {"w": w, "w_t": w, "dy_t": jnp.where(masks.nm_mask(dy.T), dy.T, 0)}
    dense_in = {"w": x, "w_t": dy, "dy_t": x}
    for name, (gemm_of, which, dense) in _GEMMS.items():
      g = gemm_of(t, n, k)
      a, b = sparse[which], dense_in[which]
      compress = jax.jit(lambda a: ops.compress(a, g, b_dtype=dtype, d_dtype=dtype))
      spmm = jax.jit(lambda c, b: ops.spmm(c, b, g, a_dtype=dtype, out_dtype=dtype))
      both = jax.jit(lambda a, b: ops.spmm(ops.compress(a, g, b_dtype=dtype, d_dtype=dtype),
                                           b, g, a_dtype=dtype, out_dtype=dtype))
      t_dense = bench_harness.time_fn(jax.jit(dense), x, w, dy, reps=reps)
      c = compress(a)
      yield bench_harness.row(f"cusparselt {name}", (t, n, k), bench_harness.time_fn(spmm, c, b, reps=reps),
                       t_dense, flops=2 * t * n * k, note="compressed operand reused")
      yield bench_harness.row(f"cusparselt {name} +compress", (t, n, k),
                       bench_harness.time_fn(both, a, b, reps=reps), t_dense, flops=2 * t * n * k,
                       note="compression in every call")


BENCHMARKS = {"cusparselt": _rows}
