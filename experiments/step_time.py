"""Step time of the paper-scale recipes on a GPU, dense against sparse, as a table with the
speed-up over dense (for docs/backends.md):

  python experiments/step_time.py                       # 124m and 350m, on the GPU it finds
  python experiments/step_time.py --variants 124m --steps 20 --json runs/step_time.json
  python experiments/step_time.py --variants tiny --allow-cpu   # a smoke run of the script

The rows are those of the GPU report's train-step section (s24jax/perf/gpu_report/steps.py, which
says how a step is timed): dense, Hu et al. and S-STE, each with sparsity.backend 'xla' and
'cusparselt'. `python -m s24jax.perf.gpu_report --sections steps` times the same steps, and the
step's anatomy, within a time budget.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from s24jax.perf.gpu_report import steps as steps_lib

ROWS = (("dense", "xla"), ("hu2024", "xla"), ("hu2024", "cusparselt"), ("s_ste", "xla"),
        ("s_ste", "cusparselt"))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--variants", default="124m,350m")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--json", default="")
  p.add_argument("--allow-cpu", action="store_true", help="run off a GPU (a smoke run)")
  args = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.allow_cpu:
    print("experiments/step_time.py: no GPU (jax.default_backend() = "
          f"{jax.default_backend()!r}); step times are only meaningful on one.")
    return 0
  device = jax.devices()[0].device_kind
  rows = []
  for variant in args.variants.split(","):
    config_variant, overrides = steps_lib.VARIANTS.get(variant, (variant, ()))
    dense = None
    for recipe, backend in ROWS:
      if backend == "cusparselt" and not on_gpu:
        continue
      r = {"variant": variant, "recipe": f"{recipe} {backend}", **steps_lib.step_seconds(
          os.path.join(steps_lib.REPO, steps_lib.RECIPES[recipe]), config_variant, backend,
          args.steps, overrides)}
      dense = dense or r["step_ms"]
      r["speedup_vs_dense"] = dense / r["step_ms"]
      rows.append(r)
      print(f"{variant:8s} {r['recipe']:20s} {r['step_ms']:9.2f} ms  "
            f"{r['tokens_per_sec']:10.0f} tok/s  x{r['speedup_vs_dense']:.3f} vs dense",
            flush=True)
  print(f"\n{device}, jax {jax.__version__}, one device, one micro-batch per step\n")
  print("| variant | recipe | micro-batch | step (ms) | tokens/s | vs dense |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['variant']} | {r['recipe']} | {r['micro_batch']} | {r['step_ms']:.2f} | "
          f"{r['tokens_per_sec']:.0f} | {r['speedup_vs_dense']:.3f}x |")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"device": device, "jax": jax.__version__, "rows": rows}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
