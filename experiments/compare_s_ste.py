"""The S-STE recipe piece by piece, against dense and hard-threshold STE (tiny GPT-2).

  python experiments/compare_s_ste.py [--root runs/compare_s_ste] [--steps 600] [--only a,b]

Runs (each its own workdir under --root; finished ones are reused, not redone, if made with
the same config, else the script stops before any run: s24jax/cli/compare.py):
  dense            the dense baseline
  ste              hard threshold, straight-through
  s_ste            soft threshold, beta fixed at init; exact weight gradient, fp32 GEMMs
  s_ste_mvue       + MVUE 2:4 estimate of dY^T for the weight gradient
  s_ste_fp8        + FP8 sparse-layer GEMMs (e4m3 forward, e5m2 gradients)
  s_ste_mvue_fp8   the full recipe: MVUE and FP8
  s_ste_rescale1   beta recomputed every step (the paper's ablation: beta grows)
  s_ste_rescale50  beta recomputed every 50 steps

Every S-STE run sets mvue / fp8 / rescale_every explicitly, so the table does not depend on
the defaults of experiments/gpt2_s_ste.py. `beta_mean` is the mean over sparse layers of
the scale at the end (train/method/scale); its value at init is the same for all S-STE
runs (same seed), so a larger one means beta grew.

Expected: S-STE below STE in val loss with a lower flip rate; MVUE and FP8 cost little;
a recomputed beta ends larger than the fixed one.
"""
from __future__ import annotations

from s24jax.cli import command

NAME = "experiments/compare_s_ste.py"
if __name__ == "__main__":
  command.guard_startup(NAME)

# pylint: disable=wrong-import-position  (after the guard: Ctrl-C during imports is one line)
import os
import sys

import command_line   # experiments/, beside this file
from s24jax.cli import compare
from s24jax import metrics as metrics_lib

S_STE = "experiments/gpt2_s_ste.py:tiny"


def _s_ste(name: str, *, mvue=False, fp8=False, rescale_every=0) -> compare.Arm:
  return compare.Arm(name, S_STE, {"sparsity.mvue": mvue, "sparsity.fp8": fp8,
                                       "sparsity.s_ste.rescale_every": rescale_every})


RUNS = [
    compare.Arm("dense", "experiments/gpt2_dense.py:tiny"),
    compare.Arm("ste", "experiments/gpt2_ste.py:tiny"),
    _s_ste("s_ste"),
    _s_ste("s_ste_mvue", mvue=True),
    _s_ste("s_ste_fp8", fp8=True),
    _s_ste("s_ste_mvue_fp8", mvue=True, fp8=True),
    _s_ste("s_ste_rescale1", rescale_every=1),
    _s_ste("s_ste_rescale50", rescale_every=50),
]


def beta_table(runs, root: str) -> str:
  """Mean beta over the sparse layers at the first log step, mid-run and at the end."""
  lines = ["| run | beta first log | beta mid | beta end |", "|---|---|---|---|"]
  for r in runs:
    path = os.path.join(root, r.name, "metrics.jsonl")
    if not os.path.exists(path):
      continue
    steps, beta = metrics_lib.series(metrics_lib.read_jsonl(path), "train/method/scale")
    if len(beta):
      mid = len(beta) // 2
      lines.append(f"| {r.name} | {beta[0]:.4f} (step {steps[0]:.0f}) | "
                   f"{beta[mid]:.4f} (step {steps[mid]:.0f}) | "
                   f"{beta[-1]:.4f} (step {steps[-1]:.0f}) |")
  return "\n".join(lines)


def main(argv=None) -> int:
  description = __doc__.split("\n")[0]
  parsed = command_line.comparison_parser(description, [r.name for r in RUNS],
                                          "runs/compare_s_ste", prog=NAME).parse_args(argv)
  command_line.compare(parsed, RUNS, description,
                       extra_keys={"train/method/scale": "beta_mean"}, appendix=beta_table)
  return 0


if __name__ == "__main__":
  from s24jax.kernels import aot   # pylint: disable=g-import-not-at-top
  aot.cpu_unless_gpu()
  command.exit_with(command.run(main, name=NAME, stopped=command_line.STOPPED))
