"""The GEMMs section: each cuSPARSELt GEMM of the sparse linear op against the dense XLA GEMM
of the same product, and against PyTorch's cuSPARSELt on the same shapes.

Per row (an FFN matrix of width d at `tokens` tokens, bf16 or FP8): the op's y, dX and dW
through 'cusparselt' against 'xla' (same inputs and MVUE key; the largest error relative to
the largest |'xla'| value), then milliseconds per call of each GEMM (forward, dgrad, wgrad):

  sparse           cuSPARSELt on an operand compressed beforehand (the step's weights)
  sparse+compress  compression and GEMM in every call (the MVUE estimate of dY^T, per batch)
  dense_xla        the dense XLA GEMM the backend runs instead (sparse_ops/common.py; FP8:
                   both operands quantized, as the 'xla' backend does)
  torch_sparse, torch_sparse+compress   torch._cslt_sparse_mm (+ torch._cslt_compress), when
                   torch with CUDA is importable (torch_peer.py)

Every time is n calls inside one jitted loop (kernels/timing.py: loop_seconds; torch: CUDA
events around n calls), divided by n, the median of REPEATS loops; n is sized from the
GEMM's FLOPs so a loop takes about LOOP_SECONDS. Rows come most informative first (HEAD,
then the rest). A row costs far more than its timed loops (compiles, the op's error check,
cuSPARSELt's plan set-up per shape): on an H200 (2026-11-27) about 44 s, so 2 rows fit in the
section's 88 s at `--budget 420`; a larger --budget reaches more.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import jax
import jax.numpy as jnp

from s24jax import sparse_ops
from s24jax.gpu_report import rows as rows_lib
from s24jax.gpu_report import torch_peer
from s24jax.kernels import masks
from s24jax.kernels import timing
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.sparse_ops import common
from s24jax.sparse_ops import cusparselt_gemms as cslt

WIDTHS = (768, 1024, 1600, 2048, 4096, 8192)
TOKENS = (8192, 65536)
REPEATS = 3
LOOP_SECONDS = 0.02
ASSUMED_FLOPS = 300e12     # to size n only (an H100's dense bf16 GEMMs run at 400-700 TFLOP/s)
MIN_CALL_SECONDS = 20e-6   # a GEMM call takes at least this (launch and tail)
GEMMS = ("forward", "dgrad", "wgrad")
# The rows that run first: 124M's FFN at its train step's micro-batch (64 x 1024 tokens), the
# widest layer, FP8 at 124M, 1.5B's width, and 124M at 8192 tokens (the shape of the
# 2026-11-27 single-dispatch rows, docs/gpu_report.md).
HEAD = ((768, 65536, "fc", "bf16"), (768, 65536, "proj", "bf16"),
        (8192, 65536, "fc", "bf16"), (8192, 65536, "proj", "bf16"),
        (768, 65536, "fc", "fp8"), (768, 65536, "proj", "fp8"),
        (1600, 65536, "fc", "bf16"), (1600, 65536, "proj", "bf16"),
        (768, 8192, "fc", "bf16"), (768, 8192, "fc", "fp8"))


def plan(smoke: bool) -> list[tuple[int, int, str, str]]:
  """(width, tokens, matrix, precision) in the order they run (module docstring): HEAD, then
  every other combination of WIDTHS x TOKENS x (fc, proj) x (bf16, fp8)."""
  if smoke:
    return [(64, 256, "fc", "bf16"), (64, 256, "fc", "fp8")]
  rest = [(d, t, m, p) for p in ("bf16", "fp8") for t in reversed(TOKENS)
          for d in reversed(WIDTHS) for m in ("fc", "proj")]
  return list(HEAD) + [r for r in rest if r not in HEAD]


def calls_for(t: int, n: int, k: int, smoke: bool) -> int:
  if smoke:
    return 2
  per_call = max(2 * t * n * k / ASSUMED_FLOPS, MIN_CALL_SECONDS)
  return int(min(200, max(2, math.ceil(LOOP_SECONDS / per_call))))


def estimate_seconds(t: int, n: int, k: int, smoke: bool) -> float:
  """A row's expected cost, to skip one that cannot finish before the deadline: about 20
  compiled programs (a second each on a GPU) and their loops."""
  if smoke:
    return 15.0
  per_call = max(2 * t * n * k / ASSUMED_FLOPS, MIN_CALL_SECONDS)
  return 20.0 + 20 * (REPEATS + 1) * calls_for(t, n, k, smoke) * per_call


def _opts(fp8: bool, backend: str) -> sparse_ops.GemmOptions:
  opts = sparse_ops.GemmOptions(mvue=True, fp8=fp8, transposable=True, backend=backend,
                                fp8_backward_operands="e5m2" if fp8 else "e4m3")
  if "gemm_choice" in {f.name for f in dataclasses.fields(opts)}:
    opts = dataclasses.replace(opts, gemm_choice="sparse")   # every GEMM on cuSPARSELt
  return opts


def _operands(t: int, n: int, k: int):
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (t, k), jnp.bfloat16)                # (T, K)
  w = jax.random.normal(kw, (n, k), jnp.float32) * 0.02          # (N, K)
  w = jnp.where(masks.transposable_mask(w), w, 0)                # 2:4 along both axes
  dy = jax.random.normal(kd, (t, n), jnp.bfloat16)               # (T, N)
  return x, w, dy


def _vjp(x, w, dy, key, opts):
  y, vjp = jax.vjp(lambda x, w: sparse_ops.sparse_linear(x, w, key, opts), x, w)
  return (y, *vjp(dy))


def errors_vs_xla(x, w, dy, fp8: bool) -> dict[str, float]:
  """Largest |cusparselt - xla| over the largest |xla| of y, dX and dW."""
  key = jax.random.key(1)
  outs = {}
  for backend in ("xla", "cusparselt"):
    opts = _opts(fp8, backend)
    outs[backend] = jax.jit(lambda x, w, dy, opts=opts: _vjp(x, w, dy, key, opts))(x, w, dy)
  rel = jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                / jnp.maximum(jnp.max(jnp.abs(b.astype(jnp.float32))), 1e-30))   # on the device
  return {what: float(rel(a, b))
          for what, a, b in zip(("y", "dX", "dW"), outs["cusparselt"], outs["xla"])}


def _gemm_programs(x, w, dy, fp8: bool):
  """{gemm: (cuSPARSELt Gemm, A array, B array, format, the dense GEMM and its operands)}."""
  t, k = x.shape
  n = w.shape[0]
  opts = _opts(fp8, "cusparselt")
  fwd_fmt, bwd_fmt = cslt.formats(opts)
  tn = fp8                                   # 8-bit operands: the TN layout only (rules R3)
  wc = w.astype(x.dtype)                                         # (N, K)
  est = jnp.where(masks.nm_mask(dy.T), dy.T, 0)                  # (N, T), 2:4 along T
  return opts, {
      "forward": (cslt.fwd_gemm(t, n, k), wc, x, fwd_fmt,
                  (lambda x, w: common.fwd_gemm(x, w, opts), x, wc)),
      "dgrad": (cslt.dgrad_gemm(t, n, k, tn), wc.T if tn else wc, dy, bwd_fmt,
                (lambda dy, w: common.dgrad_gemm(dy, w, opts), dy, wc)),
      "wgrad": (cslt.wgrad_gemm(t, n, k, tn), est, x.T if tn else x, bwd_fmt,
                (lambda est, x: common.wgrad_product(est, x, opts), est, x)),
  }


def gemm_times(x, w, dy, fp8: bool, calls: int, repeats: int, peer: bool) -> tuple[dict, dict]:
  """({gemm: {what: ms}}, {gemm/what: error}): a timing that fails is None with its error."""
  opts, programs = _gemm_programs(x, w, dy, fp8)
  ms, errors = {}, {}

  def timed(gemm, what, fn, *args):
    try:
      ms[gemm][what] = 1e3 * timing.loop_seconds(fn, *args, calls=calls, repeats=repeats)
    except Exception as e:  # pylint: disable=broad-except  (one cell fails, the row goes on)
      ms[gemm][what] = None
      errors[f"{gemm}/{what}"] = rows_lib.error_line(e)

  for gemm, (g, a, b, fmt, (dense, *dense_args)) in programs.items():
    ms[gemm] = {}
    qa, scale = cslt.quantize(a, fmt, opts)
    d_dtype = cslt.out_dtype(fmt, b.dtype)
    try:
      compressed = jax.jit(lambda qa, g=g, d=d_dtype: cusparselt.compress(
          qa, g, b_dtype=qa.dtype, d_dtype=d))(qa)
    except Exception as e:  # pylint: disable=broad-except
      compressed = None
      ms[gemm]["sparse"] = None
      errors[f"{gemm}/sparse"] = rows_lib.error_line(e)
    if compressed is not None:
      timed(gemm, "sparse", lambda c, b, g=g, fmt=fmt, adt=qa.dtype, s=scale:
            cslt.compressed_gemm(c, adt, s, b, g, opts, fmt), compressed, b)
    timed(gemm, "sparse+compress", lambda a, b, g=g, fmt=fmt:
          cslt.sparse_gemm(a, b, g, opts, fmt), a, b)
    timed(gemm, "dense_xla", dense, *dense_args)
    if peer:
      try:
        ms[gemm].update(torch_peer.times_ms(g, qa.dtype, d_dtype, calls=calls,
                                            repeats=repeats))
      except Exception as e:  # pylint: disable=broad-except
        ms[gemm].update({"torch_sparse": None, "torch_sparse+compress": None})
        errors[f"{gemm}/torch"] = rows_lib.error_line(e)
  return ms, errors


def run(section: rows_lib.Section, deadline: float, smoke: bool) -> None:
  """Every row of `plan`, each recorded as it ends; rows that cannot finish before
  `deadline` are recorded as skipped. --smoke: the cuSPARSELt stand-in (a CPU)."""
  peer_missing = torch_peer.unavailable()
  if peer_missing:
    section.skipped("torch peer", peer_missing)
  repeats = 1 if smoke else REPEATS
  for d, t, matrix, precision in plan(smoke):
    n, k = {"fc": (4 * d, d), "proj": (d, 4 * d)}[matrix]
    name = f"d={d} t={t} {matrix} {precision}"
    fields = dict(width=d, tokens=t, matrix=matrix, shape_NK=[n, k], precision=precision)
    left = deadline - time.time()
    if estimate_seconds(t, n, k, smoke) > left:
      section.skipped(name, f"budget: {left:.0f} s left, the row needs about "
                      f"{estimate_seconds(t, n, k, smoke):.0f} s", **fields)
      continue
    calls = calls_for(t, n, k, smoke)

    def measure(t=t, n=n, k=k, fp8=precision == "fp8", calls=calls):
      x, w, dy = _operands(t, n, k)
      out = {"max_rel_error_vs_xla": errors_vs_xla(x, w, dy, fp8)}
      out["ms"], out["errors"] = gemm_times(x, w, dy, fp8, calls, repeats, not peer_missing)
      out["calls_per_loop"] = calls
      return out

    with cusparselt.standin() if smoke else contextlib.nullcontext():
      section.guarded(name, measure, **fields)
