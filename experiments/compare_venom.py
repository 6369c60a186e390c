"""The Haziza et al. activation-sparsity recipe piece by piece (tiny GPT-2).

  python experiments/compare_venom.py [--root runs/compare_venom] [--steps 600] [--only a,b]

Runs (each its own workdir under --root; finished ones are reused, not redone, if made with
the same config, else the script stops before any run: s24jax/cli/compare.py):
  gelu_dense       the GELU dense baseline (experiments/gpt2_dense.py)
  relu2_dense      Squared-ReLU FFN, dense (experiments/gpt2_relu2_dense.py)
  relu2_act_vnm    + V:N:M activations (V=64, 2:8) into the 2nd FFN matmul, dense weights,
                   70% sparse then dense
  relu2_w24        + 2:4 S-STE weights on both FFN matrices only (no activation sparsity),
                   70% sparse then dense: separates the two sparsities' costs
  venom_recipe     the full recipe: V:N:M activations + 2:4 S-STE weights, 70% sparse then
                   dense (experiments/gpt2_venom.py)

Every run logs the activation statistics on the whole step batch at every log step
(act_sparsity.stats_sequences = 16, i.e. the 1024 tokens of the tiny batch = 16 blocks of V=64).
Columns beyond the standard ones (s24jax.cli.compare):
  zeros_end, kept_l1_end  exact-zero share and V:N:M kept-L1 share of the FFN activations,
                          mean over layers, at the last log step (dense phase if any);
  zeros_mean, kept_l1_mean the same averaged over all log steps of the run;
  val_sparse_end          val loss at the last eval before the dense phase starts (step 400
                          of 600 by default: the sparse model before dense fine-tuning).
"""
from __future__ import annotations

from s24jax.cli import command

NAME = "experiments/compare_venom.py"
if __name__ == "__main__":
  command.guard_startup(NAME)

# pylint: disable=wrong-import-position  (after the guard: Ctrl-C during imports is one line)
import os
import sys

import numpy as np

import command_line   # experiments/, beside this file
from s24jax.cli import compare
from s24jax import config_files
from s24jax import metrics as metrics_lib
from s24jax.training import model_schedule
from s24jax.methods import base as methods_base

VENOM = "experiments/gpt2_venom.py:tiny"
STATS = {"act_sparsity.stats_sequences": 16}

RUNS = [
    compare.Arm("gelu_dense", "experiments/gpt2_dense.py:tiny", dict(STATS)),
    compare.Arm("relu2_dense", "experiments/gpt2_relu2_dense.py:tiny", dict(STATS)),
    compare.Arm("relu2_act_vnm", VENOM, {**STATS, "sparsity.method": "dense"}),
    compare.Arm("relu2_w24", VENOM, {**STATS, "act_sparsity.kind": "none"}),
    compare.Arm("venom_recipe", VENOM, dict(STATS)),
]


def _extra_table(runs, root: str) -> str:
  """Activation statistics over the whole run and the val loss at the end of the sparse phase."""
  lines = ["| run | zeros_mean | kept_l1_mean | val_sparse_end (step) |", "|---|---|---|---|"]
  for r in runs:
    records = metrics_lib.read_jsonl(os.path.join(root, r.name, "metrics.jsonl"))
    cfg = config_files.load_config(r.config, r.overrides)
    dense_from = model_schedule.dense_finetune_start(methods_base.RunFacts.from_config(cfg))
    _, zeros = metrics_lib.series(records, "act/zero_frac")
    _, kept = metrics_lib.series(records, "act/kept_l1")
    steps, val = metrics_lib.series(records, "val/loss")
    # no dense phase: nothing to report (the final val loss is in the table above)
    sparse = steps <= dense_from if dense_from < cfg.total_steps else np.zeros(len(steps), bool)
    val_sparse = f"{val[sparse][-1]:.3f} ({int(steps[sparse][-1])})" if sparse.any() else "-"
    lines.append(f"| {r.name} | {np.mean(zeros):.3f} | {np.mean(kept):.3f} | {val_sparse} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  description = __doc__.split("\n")[0]
  parsed = command_line.comparison_parser(description, [r.name for r in RUNS],
                                          "runs/compare_venom", prog=NAME).parse_args(argv)
  command_line.compare(parsed, RUNS, description,
                       extra_keys={"act/zero_frac": "zeros_end", "act/kept_l1": "kept_l1_end"},
                       appendix=_extra_table)
  return 0


if __name__ == "__main__":
  from s24jax.kernels import aot   # pylint: disable=g-import-not-at-top
  aot.cpu_unless_gpu()
  command.exit_with(command.run(main, name=NAME, stopped=command_line.STOPPED))
