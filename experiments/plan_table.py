"""The planner's table: every GPT-2 size x {dense, s_ste, t_sr_ste_df} x {1, 8} GPUs.

  python experiments/plan_table.py [--gpu h100] [--root runs/plans] [--sizes 124m,...]

Runs `python -m s24jax.perf.plan --config experiments/gpt2_<method>.py:<size> --gpu GPU --devices N
--json ...` for each cell (one process each: a process compiles for one GPU; finished cells
are reused) and prints a markdown table: per-device memory, whether it fits, whether XLA had
to rematerialize, the micro-batch and accumulation, FLOPs per step, and for the cells that do
not fit as configured, the largest micro-batch per device that does. Needs the CUDA compile
plugin (requirements-gpu-aot.txt). Measured table: docs/scaling.md, "Planning a run".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SIZES = ("124m", "350m", "774m", "1558m")
METHODS = ("dense", "s_ste", "t_sr_ste_df")


def cell(root: str, gpu: str, size: str, method: str, devices: int) -> dict:
  out = os.path.join(root, f"{gpu}_{method}_{size}_{devices}.json")
  if not os.path.exists(out):
    cmd = [sys.executable, "-m", "s24jax.perf.plan", "--config",
           f"experiments/gpt2_{method}.py:{size}", "--gpu", gpu, "--devices", str(devices),
           "--json", out]
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=False)
  with open(out, encoding="utf-8") as f:
    return json.load(f)


def row(r: dict) -> str:
  gib = lambda b: f"{b / 2**30:.1f}"   # pylint: disable=unnecessary-lambda-assignment
  best = r.get("largest_fitting_micro_batch")
  suggestion = ("-" if r["fits"] else
                f"{best} (accum {r['grad_accum_steps_at_largest']})" if best else "none")
  return (f"| {r['params'] / 1e6:.0f}M | {r['config']} | {r['devices']} | "
          f"{r['mesh']['data']}x{r['mesh']['fsdp']} | {r['micro_batch']} x {r['grad_accum_steps']} | "
          f"{gib(r['argument_size_in_bytes'])} | {gib(r['temp_size_in_bytes'])} | "
          f"{gib(r['total_bytes_per_device'])} | {'yes' if r['fits'] else 'NO'} | "
          f"{'YES' if r['xla_rematerialized'] else 'no'} | {r['flops_per_step']:.3g} | "
          f"{suggestion} |")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--gpu", default="h100")
  p.add_argument("--root", default="runs/plans")
  p.add_argument("--sizes", default=",".join(SIZES))
  p.add_argument("--methods", default=",".join(METHODS))
  args = p.parse_args(argv)
  os.makedirs(args.root, exist_ok=True)
  lines = ["| model | method | GPUs | mesh data x fsdp | micro x accum | arguments GiB | "
           "temporaries GiB | total GiB/GPU | fits | XLA remat | FLOPs/step | "
           "largest micro that fits |", "|" + "---|" * 12]
  for size in args.sizes.split(","):
    for method in args.methods.split(","):
      for devices in (1, 8):
        lines.append(row(cell(args.root, args.gpu, size, method, devices)))
  table = "\n".join(lines)
  print(table)
  with open(os.path.join(args.root, f"table_{args.gpu}.md"), "w", encoding="utf-8") as f:
    f.write(table + "\n")


if __name__ == "__main__":
  main()
