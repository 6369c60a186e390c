"""The README quick start's expected figures as a band: seeds x XLA thread counts.

  python experiments/quickstart_band.py [--root runs/quickstart_band] [--seeds 0,1,2]
      [--threads 1,2]

Runs the quick start (`python launch.py --config experiments/gpt2_s_ste.py:small`) once per
seed and per thread count (the process pinned to that many cores: XLA:CPU then uses that many
threads, and its float reductions, hence the losses, depend on it, as they do on the CPU's
vector width). The spread over seeds bounds what another machine's rounding can do to one
seed, so the band printed, mean ± 3 sd over all runs of the final train and val loss, is
what a user's quick start should land in. Measured: README, "Quick start".

Each run is its own workdir under --root, reused if finished, and resumed if stopped, but only
if made with the same config (else the script stops before any run: s24jax/cli/compare.py's
check_reusable); launch.py's output is appended to the workdir's launch.out. A run that fails
stops the script with its exit code, one line naming its launch.out. Ctrl-C (or SIGTERM)
stops the run in progress as launch.py does (it saves its step): exit code 75.
"""
from __future__ import annotations

from s24jax.cli import command

NAME = "experiments/quickstart_band.py"
if __name__ == "__main__":
  command.guard_startup(NAME)

# pylint: disable=wrong-import-position  (after the guard: Ctrl-C during imports is one line)
import json
import os
import subprocess
import sys

import numpy as np

from s24jax.cli import args
from s24jax.cli import compare
from s24jax.training import validate

import command_line  # pylint: disable=wrong-import-order  (experiments/, beside this file)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_START = os.path.join(ROOT, "experiments", "gpt2_s_ste.py") + ":small"
KEYS = ("train/loss", "val/loss")


def workdir_of(root: str, seed: int, threads: int) -> str:
  return os.path.join(root, f"seed{seed}_threads{threads}")


def check(workdir: str, seed: int) -> None:
  """The run in `workdir`, if any, is the quick start with `seed` (compare.check_reusable)."""
  compare.check_reusable(workdir, validate.load_config(QUICK_START, {"seed": seed}),
                         remedy=f"Choose another --root, or move {workdir} away")


def run(workdir: str, seed: int, threads: int) -> dict[str, float]:
  final = os.path.join(workdir, "final_metrics.json")
  if not os.path.exists(final):
    cores = sorted(os.sched_getaffinity(0))[:threads]
    cmd = [sys.executable, os.path.join(ROOT, "launch.py"), "--config", QUICK_START,
           "--workdir", workdir, f"--config.seed={seed}"]
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "launch.out")
    with open(out, "a", encoding="utf-8") as log:
      child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    with command_line.stopping_children([child]):
      command_line.pin(child, set(cores))
      code = child.wait()
    if code:
      raise command_line.ChildFailed(f"the quick start of seed {seed} on {threads} thread(s) "
                                     f"failed with exit code {code}: {out} says why", code)
  with open(final, encoding="utf-8") as f:
    return json.load(f)


def main(argv=None) -> int:
  cores = len(os.sched_getaffinity(0))
  p = command.Parser(prog=NAME, description=__doc__.split("\n", maxsplit=1)[0])
  p.add_argument("--root", default="runs/quickstart_band",
                 type=args.output_folder("the quick start runs", "--root"))
  p.add_argument("--seeds", default="0,1,2", type=command_line.integers(minimum=0))
  p.add_argument("--threads", default="1,2", help=f"at most the {cores} cores this process "
                 "may use", type=command_line.integers(minimum=1, maximum=cores))
  parsed = p.parse_args(argv)
  for threads in parsed.threads:   # every run checked before the first starts
    for seed in parsed.seeds:
      check(workdir_of(parsed.root, seed, threads), seed)
  rows = []
  for threads in parsed.threads:
    for seed in parsed.seeds:
      final = run(workdir_of(parsed.root, seed, threads), seed, threads)
      rows.append((seed, threads, *[final[k] for k in KEYS]))
      print(f"seed {seed}, {threads} thread(s): " +
            ", ".join(f"{k} {v:.4f}" for k, v in zip(KEYS, rows[-1][2:])), flush=True)
  if len(rows) < 2:
    print("one run: no spread to band (give more --seeds or --threads)")
    return 0
  for i, key in enumerate(KEYS):
    xs = np.array([r[2 + i] for r in rows])
    sd = xs.std(ddof=1)
    print(f"{key}: {xs.mean():.3f} ± {3 * sd:.3f} (mean ± 3 sd of {len(xs)} runs; "
          f"band [{xs.mean() - 3 * sd:.3f}, {xs.mean() + 3 * sd:.3f}], "
          f"runs span [{xs.min():.3f}, {xs.max():.3f}])")
  return 0


if __name__ == "__main__":
  command.exit_with(command.run(main, name=NAME, stopped=command_line.STOPPED))
