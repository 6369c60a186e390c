"""MST vs dense GPT-2 at equal steps: final val loss and total training FLOPs.

  python experiments/compare_mst.py [--variant tiny] [--steps N] [--root runs/compare_mst]
      [--only a,b]

Runs, each in its own workdir under --root (finished runs are reused if made with the same
config, else the script stops before any run: s24jax/cli/compare.py):
  dense                    experiments/gpt2_dense.py
  mst                      experiments/gpt2_mst.py: the reference procedure (every linear layer
                           and the tied head sparse, local ∪ strided attention in the middle
                           half)
  mst_no_sparse_attention  the same with dense causal attention throughout
  mst_dense_head           the same with the tied embedding / head dense (the 2:4 recipes' set)
  mst_ours_options         our previous variant through the options: dense head, dense start,
                           cosine ramps from 0, forced pruning on top, no regrowth of
                           just-dropped entries, moments reset, round()ed counts, update steps
                           also train
and prints a markdown table (and writes it to ROOT/table.md, replacing only an earlier table
of a comparison script): val/train loss, the run's total training FLOPs
(s24jax/training/flops.py), the reduction factor against the dense run (dense FLOPs / run FLOPs), and
the same factor without the lm head (dense or sparse). The MST workdirs get mst_schedule.png
(target sparsity per phase, drop fraction, attention window, and the sparsity after every
topology update).

The tiny model's 50k-vocabulary head is 94% of its dense FLOPs, so the total moves with the
head only. Measured: docs/results.md, "Mixed Sparsity Training"; the paper-scale number is the 124m plan
(`python -m s24jax.cli.flops experiments/gpt2_mst.py:124m`).
"""
from __future__ import annotations

from s24jax.cli import command

NAME = "experiments/compare_mst.py"
if __name__ == "__main__":
  command.guard_startup(NAME)

# pylint: disable=wrong-import-position  (after the guard: Ctrl-C during imports is one line)
import os
import sys

import command_line   # experiments/, beside this file
from s24jax.cli import compare
from s24jax.training import config as config_lib

FLOP_KEYS = ("flops_total", "flops_reduction", "flops_reduction_no_head")
DENSE_HEAD = ("*/attn/*", "*/mlp/*")
# The variant s24jax had before it followed the reference (docs/algorithms.md, MST options).
OURS = {"sparsity.sparse_layers": DENSE_HEAD, "sparsity.mst.init": "dense",
        "sparsity.mst.schedule": "cosine_ramps", "sparsity.mst.forced_prune": "on_top",
        "sparsity.mst.regrow_dropped": False, "sparsity.mst.reset_moments": True,
        "sparsity.mst.count_rounding": "round", "sparsity.mst.train_on_update_step": True}


RUN_NAMES = ("dense", "mst", "mst_no_sparse_attention", "mst_dense_head", "mst_ours_options")


def arms(variant: str, steps: int | None) -> list[compare.Arm]:
  """The runs of RUN_NAMES at `variant`; a shortened run (`steps`) keeps a few evaluations
  (compare.script_main sets total_steps itself)."""
  common = {"eval_every": max(1, steps // 4)} if steps else {}
  dense, mst = f"experiments/gpt2_dense.py:{variant}", f"experiments/gpt2_mst.py:{variant}"
  overrides = (common, common, {**common, "sparsity.mst.sparse_attention": "causal"},
               {**common, "sparsity.sparse_layers": DENSE_HEAD}, {**common, **OURS})
  return [compare.Arm(name, dense if name == "dense" else mst, dict(o))
          for name, o in zip(RUN_NAMES, overrides)]


def main(argv=None) -> int:
  description = __doc__.splitlines()[0]
  parser = command_line.comparison_parser(description, RUN_NAMES, "runs/compare_mst", prog=NAME)
  parser.add_argument("--variant", default="tiny", choices=config_lib.VARIANTS)
  parsed = parser.parse_args(argv)
  command_line.compare(parsed, arms(parsed.variant, parsed.steps), description,
                       extra_keys={k: k for k in FLOP_KEYS})
  if parsed.only is None or "mst" in parsed.only:
    print(f"schedule plot: {os.path.join(parsed.root, 'mst', 'mst_schedule.png')}")
  return 0


if __name__ == "__main__":
  from s24jax.kernels import aot   # pylint: disable=g-import-not-at-top
  aot.cpu_unless_gpu()
  command.exit_with(command.run(main, name=NAME, stopped=command_line.STOPPED))
