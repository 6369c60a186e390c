"""GPU evidence in one command: `python -m s24jax.gpu_report` on one GPU (about 8 minutes).

  python -m s24jax.gpu_report                    # writes docs/gpu_report.md and .json
  python -m s24jax.gpu_report --out runs/report --skip-tests
  python -m s24jax.gpu_report --smoke --out /tmp/r   # CPU: tiny shapes, the cuSPARSELt stand-in

It runs, in this order, and writes what it saw (the GPU, its driver, the versions, every
figure and the command) to `<out>/gpu_report.md` and `<out>/gpu_report.json`:

  1. the `gpu`-marked tests (`pytest -m gpu`), with CUSPARSELT_LOG_LEVEL=1 and
     CUSPARSELT_LOG_FILE=<out>/cusparselt_log/%i.log, so a GEMM the library refuses names
     its op, order and type there;
  2. every cuSPARSELt GEMM of the sparse linear op (forward, dX of a transposable mask, the
     MVUE dW; bf16 and FP8) at the FFN shapes of GPT-2 124M to 1.5B, through the real op
     against the 'xla' backend with the same inputs and key (largest relative error), and each
     GEMM's time (compression included, and the compressed operand reused) against the dense
     XLA GEMM of the same product;
  3. the train step of dense, the Hu et al. recipe and the S-STE recipe at 124m and 350m with
     sparsity.backend 'xla' and 'cusparselt' (one device, one micro-batch of the config's
     size): median step time, tokens/s and XLA's compiled memory per device.

Without a GPU it says so and exits 2. `--smoke` runs the same code on a CPU at tiny shapes
with the cuSPARSELt stand-in (kernels/cusparselt/ops.py), the pytest step left out: the test
suite runs it so the script stays working; its figures say nothing about a GPU. Nothing here
has run on a GPU yet (docs/backends.md).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from s24jax import config_files
from s24jax import model as model_lib
from s24jax import run_spec
from s24jax import sparse_ops
from s24jax import train
from s24jax.kernels import masks
from s24jax.kernels.cusparselt import library
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.sparse_ops import cusparselt as cslt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_NO_GPU = 2
# GPT-2's widths (124M, 350M, 774M, 1.5B); the FFN's hidden size is 4 d.
WIDTHS = (768, 1024, 1280, 1600)
TOKENS = 8 * 1024                        # one micro-batch: 8 sequences of 1024
RECIPES = (("dense", "experiments/gpt2_dense.py", ("xla",)),
           ("hu2024", "experiments/gpt2_t_sr_ste_df.py", ("xla", "cusparselt")),
           ("s_ste", "experiments/gpt2_s_ste.py", ("xla", "cusparselt")))
STEP_VARIANTS = ("124m", "350m")
# --smoke: tiny shapes, and a 1-layer, 64-wide model with a 256-token vocabulary.
SMOKE = dict(widths=(64,), tokens=256, variants=("tiny",), steps=2, reps=2, matrices=("fc",),
             recipes=RECIPES[1:2],
             overrides=("model.num_layers=1", "model.d_model=64", "model.num_heads=2",
                        "model.seq_len=64", "model.vocab_size=256", "batch_size=4"))


def _median_seconds(fn, *args, reps: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def environment() -> dict:
  dev = jax.devices()[0]
  env = {"device": dev.device_kind, "platform": dev.platform,
         "compute_capability": getattr(dev, "compute_capability", None),
         "jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None) or
         __import__("jaxlib").__version__, "python": platform.python_version(),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  try:
    env["cusparselt"] = library.toolchain().cusparselt_version
  except library.Unavailable as e:
    env["cusparselt"] = f"unavailable: {e}"
  try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
  except (OSError, subprocess.TimeoutExpired) as e:
    env["nvidia_smi"] = f"not run: {e}"
  return env


def gpu_tests(out: str) -> dict:
  """`pytest -m gpu` with cuSPARSELt's error log on; its summary line and exit code."""
  log_dir = os.path.join(out, "cusparselt_log")
  os.makedirs(log_dir, exist_ok=True)
  env = dict(os.environ, CUSPARSELT_LOG_LEVEL="1",
             CUSPARSELT_LOG_FILE=os.path.join(log_dir, "%i.log"))
  start = time.time()
  run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p",
                        "no:cacheprovider"], cwd=REPO, env=env, capture_output=True, text=True)
  lines = [l for l in run.stdout.splitlines() if l.strip()]
  return {"exit_code": run.returncode, "summary": lines[-1] if lines else run.stderr[-500:],
          "seconds": round(time.time() - start, 1), "tail": "\n".join(lines[-40:])}


def _operands(t: int, n: int, k: int):
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (t, k), jnp.bfloat16)
  w = jax.random.normal(kw, (n, k), jnp.float32) * 0.02
  w = jnp.where(masks.transposable_mask(w), w, 0)       # 2:4 along both axes
  dy = jax.random.normal(kd, (t, n), jnp.bfloat16)
  return x, w, dy


def gemm_rows(widths, tokens: int, reps: int, matrices=("fc", "proj")) -> list[dict]:
  """Per FFN matrix and precision: the op's y, dX, dW against 'xla', and each GEMM's time."""
  rows = []
  key = jax.random.key(1)
  for d in widths:
    shapes = {"fc": (4 * d, d), "proj": (d, 4 * d)}
    for name in matrices:
      n, k = shapes[name]
      x, w, dy = _operands(tokens, n, k)
      for fp8 in (False, True):
        row = {"width": d, "matrix": name, "shape_NK": [n, k], "tokens": tokens,
               "precision": "fp8" if fp8 else "bf16"}
        errors = {}
        outs = {}
        for backend in ("xla", "cusparselt"):
          opts = sparse_ops.GemmOptions(mvue=True, fp8=fp8, transposable=True, backend=backend,
                                        fp8_backward_operands="e5m2" if fp8 else "e4m3")
          f = jax.jit(lambda x, w, dy, opts=opts: _vjp(x, w, dy, key, opts))
          outs[backend] = [np.asarray(a, np.float32) for a in f(x, w, dy)]
        for what, a, b in zip(("y", "dX", "dW"), outs["cusparselt"], outs["xla"]):
          errors[what] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        row["max_rel_error_vs_xla"] = errors
        row["ms"] = _gemm_times(x, w, dy, fp8, reps)
        rows.append(row)
  return rows


def _vjp(x, w, dy, key, opts):
  y, vjp = jax.vjp(lambda x, w: sparse_ops.sparse_linear(x, w, key, opts), x, w)
  return (y, *vjp(dy))


def _gemm_times(x, w, dy, fp8: bool, reps: int) -> dict:
  """Milliseconds of each cuSPARSELt GEMM (compressed operand reused; and with its
  compression) and of the dense XLA GEMM of the same product."""
  t, k = x.shape
  n = w.shape[0]
  opts = sparse_ops.GemmOptions(mvue=True, fp8=fp8, transposable=True, backend="cusparselt",
                                fp8_backward_operands="e5m2" if fp8 else "e4m3")
  fwd_fmt, bwd_fmt = cslt.formats(opts)
  tn = fp8
  est = jnp.where(masks.nm_mask(dy.T), dy.T, 0)
  gemms = {
      "forward": (cslt.fwd_gemm(t, n, k), w.astype(x.dtype), x, fwd_fmt,
                  lambda: x @ w.T.astype(x.dtype)),
      "dgrad": (cslt.dgrad_gemm(t, n, k, tn),
                (w.T if tn else w).astype(x.dtype), dy, bwd_fmt, lambda: dy @ w.astype(dy.dtype)),
      "wgrad": (cslt.wgrad_gemm(t, n, k, tn), est, x.T if tn else x, bwd_fmt,
                lambda: est @ x),
  }
  out = {}
  for name, (gemm, a, b, fmt, dense) in gemms.items():
    both = jax.jit(lambda a, b, gemm=gemm, fmt=fmt: cslt.sparse_gemm(a, b, gemm, opts, fmt))
    qa, sa = cslt.quantize(a, fmt, opts)
    compressed = jax.jit(lambda qa, gemm=gemm, fmt=fmt: cusparselt.compress(
        qa, gemm, b_dtype=qa.dtype, d_dtype=cslt.out_dtype(fmt, b.dtype)))(qa)
    spmm = jax.jit(lambda c, b, gemm=gemm, fmt=fmt, sa=sa, adt=qa.dtype: cslt.compressed_gemm(
        c, adt, sa, b, gemm, opts, fmt))
    out[name] = {"sparse": 1e3 * _median_seconds(spmm, compressed, b, reps=reps),
                 "sparse+compress": 1e3 * _median_seconds(both, a, b, reps=reps),
                 "dense_xla": 1e3 * _median_seconds(jax.jit(dense), reps=reps)}
  return out


def step_rows(variants, steps: int, overrides=(), recipes=RECIPES) -> list[dict]:
  """The train step of each recipe and backend: median seconds, tokens/s, compiled memory."""
  rows = []
  for variant in variants:
    for name, path, backends in recipes:
      for backend in backends:
        rows.append({"variant": variant, "recipe": name, "backend": backend,
                     **step_seconds(os.path.join(REPO, path), variant, backend, steps,
                                    overrides)})
  return rows


def step_seconds(path: str, variant: str, backend: str, steps: int, overrides=()) -> dict:
  """One device, one micro-batch per step (the config's micro-batch, grad_accum_steps=1)."""
  probe = config_files.load_config(f"{path}:{variant}", args=overrides)
  micro = int(probe.batch_size) // int(probe.grad_accum_steps)
  config = config_files.load_config(
      f"{path}:{variant}", args=[*overrides, f"sparsity.backend={backend}",
                                 f"batch_size={micro}", "grad_accum_steps=1",
                                 "model.dtype=bfloat16"])
  spec = run_spec.RunSpec.build(config)
  model = model_lib.build(spec.model_cfg)
  state = jax.jit(lambda: spec.fresh_state(0))()
  tx = spec.tx(state.params, state.sparsity)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, spec.model_cfg.vocab_size,
                                    (micro, spec.model_cfg.seq_len)), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens}
  compiled = train.train_step.lower(state, batch, model=model, tx=tx).compile()
  memory = compiled.memory_analysis()
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
           - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  times = []
  for i in range(2 + steps):
    start = time.perf_counter()
    state, metrics = train.train_step(state, batch, model=model, tx=tx)
    jax.block_until_ready(metrics["loss"])
    if i >= 2:
      times.append(time.perf_counter() - start)
  seconds = statistics.median(times)
  return {"micro_batch": micro, "step_ms": 1e3 * seconds,
          "tokens_per_sec": micro * spec.model_cfg.seq_len / seconds,
          "compiled_gib_per_device": total / 2**30,
          "final_loss": float(metrics["loss"] / metrics["count"])}


def markdown(report: dict) -> str:
  env = report["environment"]
  lines = ["# GPU report (`python -m s24jax.gpu_report`)", "",
           f"Command: `{report['command']}`  ", f"Date: {env['date']}  ",
           f"Device: {env['device']} (compute capability {env['compute_capability']}); "
           f"nvidia-smi: {env['nvidia_smi']}  ",
           f"jax {env['jax']}, jaxlib {env['jaxlib']}, cuSPARSELt {env['cusparselt']}, "
           f"Python {env['python']}", ""]
  if report.get("smoke"):
    lines += ["**Smoke run on a CPU with the cuSPARSELt stand-in: tiny shapes; no figure here "
              "says anything about a GPU.**", ""]
  if "gpu_tests" in report:
    t = report["gpu_tests"]
    lines += ["## `gpu` tests", "", f"`pytest -m gpu`: {t['summary']} (exit {t['exit_code']}, "
              f"{t['seconds']} s; cuSPARSELt's error log under cusparselt_log/)", ""]
  lines += ["## cuSPARSELt GEMMs against 'xla' and the dense GEMM", "",
            "| width | matrix (N, K) | tokens | precision | max rel. err. y / dX / dW | "
            "forward ms (sparse / +compress / dense) | dgrad ms | wgrad ms |",
            "|---|---|---|---|---|---|---|---|"]
  for r in report["gemms"]:
    e, ms = r["max_rel_error_vs_xla"], r["ms"]
    def cell(gemm, ms=ms):
      return " / ".join(f"{ms[gemm][c]:.3f}" for c in ("sparse", "sparse+compress",
                                                        "dense_xla"))
    lines.append(f"| {r['width']} | {r['matrix']} {tuple(r['shape_NK'])} | {r['tokens']} | "
                 f"{r['precision']} | {e['y']:.1e} / {e['dX']:.1e} / {e['dW']:.1e} | "
                 f"{cell('forward')} | {cell('dgrad')} | {cell('wgrad')} |")
  lines += ["", "## Train step (one device, one micro-batch)", "",
            "| variant | recipe | backend | micro-batch | step ms | tokens/s | "
            "compiled GiB/device |",
            "|---|---|---|---|---|---|---|"]
  for r in report["steps"]:
    lines.append(f"| {r['variant']} | {r['recipe']} | {r['backend']} | {r['micro_batch']} | "
                 f"{r['step_ms']:.2f} | {r['tokens_per_sec']:.0f} | "
                 f"{r['compiled_gib_per_device']:.2f} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m s24jax.gpu_report",
                              description=__doc__.split("\n", maxsplit=1)[0])
  p.add_argument("--out", default=os.path.join(REPO, "docs"), help="folder of the report")
  p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, the stand-in")
  p.add_argument("--skip-tests", action="store_true", help="leave out `pytest -m gpu`")
  p.add_argument("--steps", type=int, default=10, help="timed train steps per row")
  p.add_argument("--reps", type=int, default=20, help="timed repetitions per GEMM")
  args = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.smoke:
    print(f"s24jax.gpu_report: no GPU here (jax.default_backend() = "
          f"{jax.default_backend()!r}): the report is GPU evidence. Run it on a GPU host, "
          "or with --smoke for a CPU check of the script.", file=sys.stderr)
    return EXIT_NO_GPU
  os.makedirs(args.out, exist_ok=True)
  if args.smoke:
    size = dict(SMOKE)
  else:
    size = dict(widths=WIDTHS, tokens=TOKENS, variants=STEP_VARIANTS, steps=args.steps,
                reps=args.reps, matrices=("fc", "proj"), recipes=RECIPES, overrides=())
  report = {"command": " ".join(["python -m s24jax.gpu_report"] + list(argv or sys.argv[1:])),
            "smoke": args.smoke, "environment": environment()}
  if on_gpu and not args.skip_tests:
    report["gpu_tests"] = gpu_tests(args.out)
    print(f"gpu tests: {report['gpu_tests']['summary']}", flush=True)
  stand_in = cusparselt.standin() if not on_gpu else contextlib.nullcontext()
  with stand_in:
    report["gemms"] = gemm_rows(size["widths"], size["tokens"], size["reps"], size["matrices"])
    print(f"GEMMs: {len(report['gemms'])} rows", flush=True)
    report["steps"] = step_rows(size["variants"], size["steps"], size["overrides"],
                                size["recipes"])
  with open(os.path.join(args.out, "gpu_report.json"), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  text = markdown(report)
  with open(os.path.join(args.out, "gpu_report.md"), "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
