"""Step time of the paper-scale recipes on a GPU, dense against sparse (cuSPARSELt and xla).

  python experiments/step_time.py                       # 124m and 350m, on the GPU it finds
  python experiments/step_time.py --variants 124m --steps 20 --json runs/step_time.json
  python experiments/step_time.py --variants tiny --allow-cpu   # a smoke run of the script

For each variant, the jitted train step of: the dense baseline, the Hu et al. recipe
(experiments/gpt2_t_sr_ste_df.py) and the S-STE recipe (experiments/gpt2_s_ste.py), each
with sparsity.backend 'xla' (2:4 weights multiplied densely) and 'cusparselt' (the sparse
tensor cores). One device; the micro-batch is the config's and the batch one micro-batch
(grad_accum_steps=1), so a row is one forward + backward + update. Median of `--steps` timed
steps after 3 warm-up steps, on random tokens. Prints the table for docs/backends.md, with the
speed-up over dense. Nothing here has run on a GPU yet (no GPU was available to write it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from s24jax.gpu_report import step_seconds

RECIPES = (("dense", "experiments/gpt2_dense.py", "xla"),
           ("hu2024 xla", "experiments/gpt2_t_sr_ste_df.py", "xla"),
           ("hu2024 cusparselt", "experiments/gpt2_t_sr_ste_df.py", "cusparselt"),
           ("s_ste xla", "experiments/gpt2_s_ste.py", "xla"),
           ("s_ste cusparselt", "experiments/gpt2_s_ste.py", "cusparselt"))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--variants", default="124m,350m")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--json", default="")
  p.add_argument("--allow-cpu", action="store_true", help="run off a GPU (a smoke run)")
  args = p.parse_args(argv)
  if jax.default_backend() != "gpu" and not args.allow_cpu:
    print("experiments/step_time.py: no GPU (jax.default_backend() = "
          f"{jax.default_backend()!r}); step times are only meaningful on one.")
    return 0
  device = jax.devices()[0].device_kind
  rows = []
  for variant in args.variants.split(","):
    dense = None
    for name, path, backend in RECIPES:
      if backend == "cusparselt" and jax.default_backend() != "gpu":
        continue
      r = {"variant": variant, "recipe": name, **step_seconds(path, variant, backend,
                                                              args.steps)}
      r["seconds"] = r["step_ms"] / 1e3
      dense = dense or r["seconds"]
      r["speedup_vs_dense"] = dense / r["seconds"]
      rows.append(r)
      print(f"{variant:6s} {name:20s} {1e3 * r['seconds']:9.2f} ms  "
            f"{r['tokens_per_sec']:10.0f} tok/s  x{r['speedup_vs_dense']:.3f} vs dense",
            flush=True)
  print(f"\n{device}, jax {jax.__version__}, one device, one micro-batch per step\n")
  print("| variant | recipe | micro-batch | step (ms) | tokens/s | vs dense |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['variant']} | {r['recipe']} | {r['micro_batch']} | "
          f"{1e3 * r['seconds']:.2f} | {r['tokens_per_sec']:.0f} | "
          f"{r['speedup_vs_dense']:.3f}x |")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"device": device, "jax": jax.__version__, "rows": rows}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
