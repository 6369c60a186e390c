"""The README quick start's expected figures as a band: seeds x XLA thread counts.

  python experiments/quickstart_band.py [--root runs/quickstart_band] [--seeds 0,1,2]
      [--threads 1,2]

Runs the quick start (`python launch.py --config experiments/gpt2_s_ste.py:small`) once per
seed and per thread count (the process pinned to that many cores: XLA:CPU then uses that many
threads, and its float reductions, hence the losses, depend on it, as they do on the CPU's
vector width). The spread over seeds bounds what another machine's rounding can do to one
seed, so the band printed, mean ± 3 sd over all runs of the final train and val loss, is
what a user's quick start should land in. Measured: README, "Quick start".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_START = "experiments/gpt2_s_ste.py:small"
KEYS = ("train/loss", "val/loss")


def run(workdir: str, seed: int, threads: int) -> dict[str, float]:
  final = os.path.join(workdir, "final_metrics.json")
  if not os.path.exists(final):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < threads:
      raise SystemExit(f"{threads} threads asked, {len(cores)} cores available")
    cmd = [sys.executable, os.path.join(ROOT, "launch.py"), "--config", QUICK_START,
           "--workdir", workdir, f"--config.seed={seed}"]
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "launch.out"), "w", encoding="utf-8") as log:
      subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                     preexec_fn=lambda: os.sched_setaffinity(0, set(cores[:threads])))
  with open(final, encoding="utf-8") as f:
    return json.load(f)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
  p.add_argument("--root", default="runs/quickstart_band")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--threads", default="1,2")
  args = p.parse_args(argv)
  rows = []
  for threads in [int(t) for t in args.threads.split(",")]:
    for seed in [int(s) for s in args.seeds.split(",")]:
      final = run(os.path.join(args.root, f"seed{seed}_threads{threads}"), seed, threads)
      rows.append((seed, threads, *[final[k] for k in KEYS]))
      print(f"seed {seed}, {threads} thread(s): " +
            ", ".join(f"{k} {v:.4f}" for k, v in zip(KEYS, rows[-1][2:])), flush=True)
  for i, key in enumerate(KEYS):
    xs = np.array([r[2 + i] for r in rows])
    sd = xs.std(ddof=1)
    print(f"{key}: {xs.mean():.3f} ± {3 * sd:.3f} (mean ± 3 sd of {len(xs)} runs; "
          f"band [{xs.mean() - 3 * sd:.3f}, {xs.mean() + 3 * sd:.3f}], "
          f"runs span [{xs.min():.3f}, {xs.max():.3f}])")


if __name__ == "__main__":
  main()
