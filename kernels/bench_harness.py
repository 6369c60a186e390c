"""The kernel benchmarks' tables and command line.

`python -m s24jax.kernels.bench` runs the rows of every kernel family;
`python -m s24jax.kernels.<family>` (each kernel file's `__main__`) runs its own. Both go
through `main` here with a dict of row generators: each kernel file keeps its own in
`BENCHMARKS` (name -> generator(shapes, dtype, interpret, reps) yielding row dicts, made
with `row` and `time_fn`), and `plan` says which shapes each name gets. Device timing in a
loop (what the library itself measures with) is kernels/timing.py.

This module imports no kernel file, so every kernel file may import it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from typing import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp

from . import _common as c

# Datasheet peaks per GPU (dense bf16 tensor-core FLOP/s, HBM bytes/s); sources in
# kernels/BENCHMARKS.md. pct_bw / pct_flops are against the running GPU's entry (the H100
# SXM's when the device is not listed).
PEAKS = {
    "A100": (312e12, 2.039e12),     # A100 SXM4 80GB
    "H100": (989e12, 3.35e12),      # H100 SXM5 80GB
    "B200": (2.25e15, 8.0e12),      # B200 (HGX B200 per-GPU)
}
H100_BF16, H100_BW = PEAKS["H100"]

WIDTHS = (768, 1024, 1280, 1600)
TOKENS = (16, 64, 256, 1024, 4096, 16384)
COLUMNS = ["kernel", "shape", "kernel_us", "xla_us", "xla_over_kernel", "GBps",
           "pct_bw", "TFLOPs", "pct_flops", "note"]

Benchmark = Callable[..., Iterator[dict]]   # (shapes, dtype, interpret, reps) -> rows

_PEAK = {"flops": H100_BF16, "bw": H100_BW}   # set from the device in main()


def peaks(device_kind: str) -> tuple[float, float]:
  """(dense bf16 FLOP/s, bytes/s) of the GPU whose name contains a PEAKS key."""
  for name, value in PEAKS.items():
    if name in device_kind:
      return value
  return PEAKS["H100"]


def time_fn(fn: Callable, *args, warmup: int = 3, reps: int = 20) -> float:
  """Median wall time in seconds of fn(*args), device-synchronised."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def print_table(rows: Sequence[dict], columns: Sequence[str] | None = None):
  if not rows:
    print("(no rows)")
    return
  columns = list(columns or rows[0].keys())

  def fmt(v):
    if isinstance(v, float):
      return f"{v:.4g}"
    return str(v)

  cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells))
            for i, c in enumerate(columns)]
  print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
  for row in cells:
    print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def row(kernel, shape, t_k, t_x, *, nbytes=None, flops=None, note=""):
  """One benchmark row: kernel time t_k against the XLA path's t_x (seconds)."""
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


def dense_mm(x, w):
  """The dense XLA matmul a sparse one replaces: x @ w.T, f32 accumulation."""
  return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)


def plan(small: bool, full: bool) -> dict[str, list[tuple[int, ...]]]:
  """Shapes per benchmark name: GPT-2 FFN weights (4d, d) and (d, 4d), token counts."""
  if small:
    return dict(sparsify24=[(16, 64)], transposable=[(32, 64)],
                mvue24=[(16, 64)], matmul=[(16, 64, 128)],
                matmul_bwd=[(16, 64, 128)], venom=[(32, 32)],
                gated=[(16, 16)], tcgen05=[(128, 128, 128)], cusparselt=[(64, 64, 128)])
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
      # cuSPARSELt: every GPT-2 width (d 768..1600, hidden 4d), 8k..64k tokens per device.
      cusparselt=[(t, n, k) for (n, k) in ([(4 * d, d) for d in WIDTHS]
                                           + [(d, 4 * d) for d in WIDTHS])
                  for t in ((8192, 16384, 32768, 65536) if full else (8192, 65536))],
  )


def main(benchmarks: Mapping[str, Benchmark], argv=None, *,
         prog: str = "python -m s24jax.kernels.bench", description: str = "") -> int:
  """The benchmark command line over `benchmarks` (run in their order)."""
  p = argparse.ArgumentParser(prog=prog, description=description)
  p.add_argument("--interpret", action="store_true",
                 help="run kernels in Pallas interpret mode (CPU smoke run)")
  p.add_argument("--small", action="store_true", help="tiny shapes")
  p.add_argument("--full", action="store_true", help="the whole sweep")
  p.add_argument("--only", default="",
                 help=f"comma-separated names of {', '.join(benchmarks)}")
  p.add_argument("--reps", type=int, default=None)
  p.add_argument("--json", default="", help="write rows to this JSON file")
  p.add_argument("--markdown", action="store_true")
  p.add_argument("--backend", default="", help="only this backend's rows: 'cusparselt' "
                 "(its three GEMMs against cuBLAS dense)")
  args = p.parse_args(argv)
  if args.backend:
    if args.backend not in benchmarks:
      print(f"unknown backend {args.backend!r}; valid: 'cusparselt'")
      return 2
    args.only = args.backend
  label = prog.split()[-1]   # "s24jax.kernels.bench"
  if not c.on_gpu() and not args.interpret:
    print(f"{label}: no GPU backend (jax.default_backend() = "
          f"{jax.default_backend()!r}); timings are only meaningful on a GPU. "
          f"Nothing to do. For a CPU smoke run: {prog} --interpret --small")
    return 0
  if args.interpret and not args.small:
    print(f"{label}: --interpret needs --small (interpret mode is slow).")
    return 2
  only = [s for s in args.only.split(",") if s]
  unknown = set(only) - set(benchmarks)
  if unknown:
    print(f"unknown kernel(s) {sorted(unknown)}; valid: {tuple(benchmarks)}")
    return 2
  dtype = jnp.float32 if args.interpret else jnp.bfloat16
  reps = args.reps or (2 if args.interpret else 50)
  shapes = plan(args.small, args.full)
  _PEAK["flops"], _PEAK["bw"] = peaks(jax.devices()[0].device_kind)
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}, dtype {jnp.dtype(dtype).name}, reps {reps}"
        + (", INTERPRET (timings meaningless)" if args.interpret else ""))
  rows, failures = [], 0
  for name, bench in benchmarks.items():
    if only and name not in only:
      continue
    try:
      for r in bench(shapes[name], dtype, args.interpret, reps):
        rows.append(r)
        print(json.dumps(r), flush=True)
    except Exception:  # Keep going: one broken kernel must not hide the rest.
      failures += 1
      print(f"FAILED {name}:\n{traceback.format_exc()}", flush=True)
      rows.append(dict(kernel=name, shape="-", note="FAILED (see log)"))
  print()
  print_table(rows, COLUMNS)
  if args.markdown:
    print()
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
      cells = [(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")))
               for k in COLUMNS]
      print("| " + " | ".join(cells) + " |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind,
                     jax=jax.__version__, rows=rows), f, indent=1)
  return 1 if failures else 0
