"""Benchmark every kernel against its XLA reference: `python -m s24jax.kernels.bench`.

Per kernel and shape (GPT-2 124M..1.5B FFN shapes: d in {768, 1024, 1280,
1600}, hidden 4d; token counts 16..16384; bf16) it prints the median time of
the Pallas kernel and of the XLA path it would replace (warm-up, then many
reps, each fenced by `jax.block_until_ready`), their ratio (xla / kernel: > 1
means the kernel is faster), and the achieved bandwidth (GB/s) or FLOP rate
(TFLOP/s) with their share of the running GPU's datasheet peaks (`PEAKS`:
A100, H100, B200; sources in kernels/BENCHMARKS.md).

It refuses to run on CPU (interpret-mode timings are meaningless) unless
asked for a smoke run: `python -m s24jax.kernels.bench --interpret --small`.
Options: --only name[,name] (sparsify24, transposable, mvue24, matmul,
matmul_bwd, venom, gated, tcgen05 (Blackwell only)), --reps N, --json PATH (rows as JSON),
--full (all d x all token counts; the default trims the sweep to fit one
10-minute GPU call), --markdown (print a table for kernels/BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback

import jax
import jax.numpy as jnp

from . import _common as c
from . import compressed_matmul as sm
from . import gated_activation as ga
from . import mvue24 as mv
from . import sparsify24 as sp
from . import transposable_mask as tm
from . import venom as vn

# Datasheet peaks per GPU (dense bf16 tensor-core FLOP/s, HBM bytes/s); sources in
# kernels/BENCHMARKS.md. pct_bw / pct_flops are against the running GPU's entry (the H100
# SXM's when the device is not listed).
PEAKS = {
    "A100": (312e12, 2.039e12),     # A100 SXM4 80GB
    "H100": (989e12, 3.35e12),      # H100 SXM5 80GB
    "B200": (2.25e15, 8.0e12),      # B200 (HGX B200 per-GPU)
}
H100_BF16, H100_BW = PEAKS["H100"]


def peaks(device_kind: str) -> tuple[float, float]:
  """(dense bf16 FLOP/s, bytes/s) of the GPU whose name contains a PEAKS key."""
  for name, value in PEAKS.items():
    if name in device_kind:
      return value
  return PEAKS["H100"]
WIDTHS = (768, 1024, 1280, 1600)
TOKENS = (16, 64, 256, 1024, 4096, 16384)
KERNELS = ("sparsify24", "transposable", "mvue24", "matmul", "matmul_bwd",
           "venom", "gated", "tcgen05")


_PEAK = {"flops": H100_BF16, "bw": H100_BW}   # set from the device in main()


def _row(kernel, shape, t_k, t_x, *, nbytes=None, flops=None, note=""):
  r = dict(kernel=kernel, shape=str(shape), kernel_us=t_k * 1e6,
           xla_us=t_x * 1e6, xla_over_kernel=t_x / t_k)
  if nbytes is not None:
    r["GBps"] = nbytes / t_k / 1e9
    r["pct_bw"] = 100 * nbytes / t_k / _PEAK["bw"]
  if flops is not None:
    r["TFLOPs"] = flops / t_k / 1e12
    r["pct_flops"] = 100 * flops / t_k / _PEAK["flops"]
  if note:
    r["note"] = note
  return r


def _dense_mm(x, w):
  return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)


def bench_sparsify24(shapes, dtype, interpret, reps):
  for n, k in shapes:
    w = jax.random.normal(jax.random.key(0), (n, k), dtype)
    nbytes = w.size * w.dtype.itemsize * 1.5 + w.size // 8
    for name, fast, ref in [
        ("sparsify24_hard", functools.partial(sp.compress24, interpret=interpret),
         jax.jit(sp.compress24_reference)),
        ("sparsify24_soft",
         functools.partial(sp.soft_compress24, beta=0.9, interpret=interpret),
         jax.jit(functools.partial(sp.soft_compress24_reference, beta=0.9)))]:
      yield _row(name, (n, k), c.time_fn(fast, w, reps=reps),
                 c.time_fn(ref, w, reps=reps), nbytes=nbytes)


def bench_transposable(shapes, dtype, interpret, reps):
  for n, k in shapes:
    w = jax.random.normal(jax.random.key(0), (n, k), dtype)
    for wc in (False, True):
      fast = jax.jit(functools.partial(tm.transposable_mask24,
                                       with_compressed=wc, interpret=interpret))
      ref = jax.jit(tm.transposable_compressed_reference if wc
                    else tm.transposable_mask_reference)
      out_bytes = w.size * (1 + (2 * w.dtype.itemsize * 0.5 + 0.25 if wc else 0))
      yield _row("transposable" + ("+compress" if wc else ""), (n, k),
                 c.time_fn(fast, w, reps=reps), c.time_fn(ref, w, reps=reps),
                 nbytes=w.size * w.dtype.itemsize + out_bytes)


def bench_mvue24(shapes, dtype, interpret, reps):
  for rows, tokens in shapes:
    x = jax.random.normal(jax.random.key(0), (rows, tokens), dtype)
    fast = jax.jit(functools.partial(mv.mvue24_compress, interpret=interpret))
    ref = jax.jit(mv.mvue24_reference)
    nbytes = x.size * x.dtype.itemsize * 1.5 + x.size // 8
    yield _row("mvue24", (rows, tokens), c.time_fn(fast, x, 3, reps=reps),
               c.time_fn(ref, x, 3, reps=reps), nbytes=nbytes)


def _matmul_operands(t, n, k, dtype):
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (t, k), dtype)
  values, meta = sp.compress24_reference(jax.random.normal(kw, (n, k), dtype))
  return x, values, meta, c.decompress(values, meta)


def bench_matmul(cases, dtype, interpret, reps):
  for t, n, k in cases:
    x, values, meta, dense = _matmul_operands(t, n, k, dtype)
    fast = jax.jit(functools.partial(sm.sparse24_matmul, interpret=interpret))
    nbytes = (values.size * values.dtype.itemsize + meta.size * 4
              + (x.size + t * n) * x.dtype.itemsize)
    yield _row("sparse24_matmul", (t, n, k), c.time_fn(fast, x, values, meta,
                                                       reps=reps),
               c.time_fn(jax.jit(_dense_mm), x, dense, reps=reps),
               nbytes=nbytes, flops=2 * t * n * k,
               note=f"use_pallas={sm.should_use_pallas_matmul(t, n, k)}")


def bench_matmul_bwd(cases, dtype, interpret, reps):
  for t, n, k in cases:
    x, values, meta, dense = _matmul_operands(t, n, k, dtype)
    dy = jax.random.normal(jax.random.key(1), (t, n), dtype)
    fast = jax.jit(lambda x, v, dy: jax.vjp(
        lambda x, v: sm.sparse24_matmul(x, v, meta, interpret=interpret),
        x, v)[1](dy))
    ref = jax.jit(lambda x, w, dy: jax.vjp(_dense_mm, x, w)[1](dy))
    yield _row("sparse24_matmul_bwd(dx,dvalues)", (t, n, k),
               c.time_fn(fast, x, values, dy, reps=reps),
               c.time_fn(ref, x, dense, dy, reps=reps), flops=4 * t * n * k,
               note="xla: dense dx, dW")


def bench_venom(cases, dtype, interpret, reps, v=16, m=8):
  for t, d in cases:
    h = 4 * d
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.nn.relu(jax.random.normal(kx, (t, h), dtype)) ** 2
    w2 = jax.random.normal(kw, (d, h), dtype)
    comp = jax.jit(functools.partial(vn.venom_compress, v=v, m=m,
                                     interpret=interpret))
    comp_ref = jax.jit(functools.partial(vn.venom_reference, v=v, m=m))
    yield _row(f"venom_compress({v}:2:{m})", (t, h), c.time_fn(comp, x, reps=reps),
               c.time_fn(comp_ref, x, reps=reps),
               nbytes=x.size * x.dtype.itemsize * (1 + 2 / m))
    got = comp(x)
    xs = vn.venom_decompress(*got, v, m)
    mm = jax.jit(functools.partial(vn.venom_matmul, v=v, m=m,
                                   interpret=interpret))
    yield _row(f"venom_matmul({v}:2:{m})", (t, d, h),
               c.time_fn(mm, *got, w2, reps=reps),
               c.time_fn(jax.jit(_dense_mm), xs, w2, reps=reps),
               flops=2 * t * d * h, note="TFLOPs dense-equivalent")


def bench_gated(cases, dtype, interpret, reps):
  for t, d in cases:
    h = 4 * d
    x = jax.random.normal(jax.random.key(0), (t, 2 * h), dtype)
    dy = jax.random.normal(jax.random.key(1), (t, h), dtype)
    isz = x.dtype.itemsize
    for kind in ga.ACTIVATIONS:
      fast = jax.jit(functools.partial(ga.gated_act, kind=kind,
                                       interpret=interpret))
      ref = jax.jit(functools.partial(ga.gated_act_reference, kind=kind))
      yield _row(f"{kind}_fwd", (t, 2 * h), c.time_fn(fast, x, reps=reps),
                 c.time_fn(ref, x, reps=reps), nbytes=3 * t * h * isz)
      fb = jax.jit(lambda x, dy, f=fast: jax.vjp(f, x)[1](dy)[0])
      rb = jax.jit(lambda x, dy, f=ref: jax.vjp(f, x)[1](dy)[0])
      yield _row(f"{kind}_bwd", (t, 2 * h), c.time_fn(fb, x, dy, reps=reps),
                 c.time_fn(rb, x, dy, reps=reps), nbytes=5 * t * h * isz)


def bench_tcgen05(cases, dtype, interpret, reps):
  """The three 2:4 GEMMs of a layer on Blackwell's sparse tensor cores vs the dense
  XLA GEMM of the same shape (TFLOP/s dense-equivalent)."""
  from . import tcgen05 as tc   # pylint: disable=g-import-not-at-top
  try:
    tc.check_device()
  except tc.NotBlackwellError:
    yield dict(kernel="tcgen05", shape="-", note="skipped: not a Blackwell GPU")
    return
  del interpret
  for t, n, k in cases:
    x, values, meta, dense = _matmul_operands(t, n, k, dtype)
    fwd = jax.jit(tc.forward)
    yield _row("tcgen05_forward", (t, n, k), c.time_fn(fwd, x, values, meta, reps=reps),
               c.time_fn(jax.jit(_dense_mm), x, dense, reps=reps), flops=2 * t * n * k,
               note="xla: dense x @ W~^T")


def _plan(small: bool, full: bool):
  if small:
    return dict(sparsify24=[(16, 64)], transposable=[(32, 64)],
                mvue24=[(16, 64)], matmul=[(16, 64, 128)],
                matmul_bwd=[(16, 64, 128)], venom=[(32, 32)],
                gated=[(16, 16)], tcgen05=[(128, 128, 128)])
  widths = WIDTHS if full else (768, 1600)
  weights = [(4 * d, d) for d in widths] + [(d, 4 * d) for d in widths]
  mm_tokens = TOKENS if full else (16, 64, 256, 4096)
  return dict(
      sparsify24=weights,
      transposable=weights,
      mvue24=[(4 * d, t) for d in widths for t in (1024, 16384)],
      matmul=[(t, n, k) for (n, k) in weights for t in mm_tokens],
      matmul_bwd=[(t, n, k) for (n, k) in weights[:1] for t in (64, 4096)],
      venom=[(t, d) for d in widths for t in (1024, 16384)],
      gated=[(t, d) for d in widths for t in (1024, 16384)],
      tcgen05=[(t, n, k) for (n, k) in weights for t in (4096, 16384)],
  )


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m s24jax.kernels.bench",
                              description=__doc__.split("\n")[0])
  p.add_argument("--interpret", action="store_true",
                 help="run kernels in Pallas interpret mode (CPU smoke run)")
  p.add_argument("--small", action="store_true", help="tiny shapes")
  p.add_argument("--full", action="store_true", help="the whole sweep")
  p.add_argument("--only", default="", help="comma-separated kernel names")
  p.add_argument("--reps", type=int, default=None)
  p.add_argument("--json", default="", help="write rows to this JSON file")
  p.add_argument("--markdown", action="store_true")
  args = p.parse_args(argv)
  if not c.on_gpu() and not args.interpret:
    print(f"kernels.bench: no GPU backend (jax.default_backend() = "
          f"{jax.default_backend()!r}); timings are only meaningful on a GPU. "
          "Nothing to do. For a CPU smoke run: "
          "python -m s24jax.kernels.bench --interpret --small")
    return 0
  if args.interpret and not args.small:
    print("kernels.bench: --interpret needs --small (interpret mode is slow).")
    return 2
  only = [s for s in args.only.split(",") if s]
  unknown = set(only) - set(KERNELS)
  if unknown:
    print(f"unknown kernel(s) {sorted(unknown)}; valid: {KERNELS}")
    return 2
  dtype = jnp.float32 if args.interpret else jnp.bfloat16
  reps = args.reps or (2 if args.interpret else 50)
  plan = _plan(args.small, args.full)
  fns = dict(sparsify24=bench_sparsify24, transposable=bench_transposable,
             mvue24=bench_mvue24, matmul=bench_matmul,
             matmul_bwd=bench_matmul_bwd, venom=bench_venom,
             gated=bench_gated, tcgen05=bench_tcgen05)
  _PEAK["flops"], _PEAK["bw"] = peaks(jax.devices()[0].device_kind)
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}, dtype {jnp.dtype(dtype).name}, reps {reps}"
        + (", INTERPRET (timings meaningless)" if args.interpret else ""))
  rows, failures = [], 0
  for name in KERNELS:
    if only and name not in only:
      continue
    try:
      for r in fns[name](plan[name], dtype, args.interpret, reps):
        rows.append(r)
        print(json.dumps(r), flush=True)
    except Exception:  # Keep going: one broken kernel must not hide the rest.
      failures += 1
      print(f"FAILED {name}:\n{traceback.format_exc()}", flush=True)
      rows.append(dict(kernel=name, shape="-", note="FAILED (see log)"))
  cols = ["kernel", "shape", "kernel_us", "xla_us", "xla_over_kernel", "GBps",
          "pct_bw", "TFLOPs", "pct_flops", "note"]
  print()
  c.print_table(rows, cols)
  if args.markdown:
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
      cells = [(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")))
               for k in cols]
      print("| " + " | ".join(cells) + " |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind,
                     jax=jax.__version__, rows=rows), f, indent=1)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
