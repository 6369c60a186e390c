"""Hu et al. 2024 piece by piece, against dense and STE (tiny GPT-2).

  python experiments/compare_hu2024.py [--root runs/compare_hu2024] [--steps 600] [--only a,b]

Runs (each its own workdir under --root; finished ones are reused, not redone, if made with
the same config, else the script stops before any run: s24jax/cli/compare.py):
  dense              the dense baseline
  ste                hard threshold, straight-through, no decay
  sr_ste_grad        SR-STE, lambda_W = 6e-5 on the gradients (after clipping, before AdamW)
  sr_ste_weights     SR-STE, lambda_W = 6e-5 on the weights (decoupled, original SR-STE)
  recipe             the full recipe, experiments/gpt2_t_sr_ste_df.py: transposable masks
                     refreshed every 40 steps, MVUE weight gradient, lambda_W = 6e-5 on the
                     gradients, dense fine-tuning for the last 1/6 of the steps
  sr_ste_grad_auto   SR-STE on the gradients, lambda_W adjusted from 6e-5 by the warm-up
                     controller (methods/sr_ste.py) during steps [100, 200), then frozen
  recipe_auto        the recipe with lambda_W adjusted by the controller (steps [100, 200)),
                     which steers on the per-step flip rate of the transposable mask
  recipe_no_mvue     the recipe with the exact weight gradient dY^T x (no MVUE)
  recipe_refresh1    the recipe with the transposable mask recomputed every step
  recipe_refresh40   the recipe with the paper's fixed 40-step refresh (no drift trigger)

Columns: val/train loss at the end (after dense fine-tuning for the recipe rows), the flip
rate (per step, of the plain 2:4 mask of the latent weights) of the last log of the sparse
phase and its peak, lambda_W at the end (`lambda`), the transposable mask's kept magnitude
relative to the plain 2:4 mask (`kept_ratio`, last refresh), the refresh rate (`refresh`:
share of steps that refreshed the cached mask) and whether the flip-rate warning was on at
the last log (`flip_warn`).
"""
from __future__ import annotations

from s24jax.cli import command

NAME = "experiments/compare_hu2024.py"
if __name__ == "__main__":
  command.guard_startup(NAME)

# pylint: disable=wrong-import-position  (after the guard: Ctrl-C during imports is one line)
import sys

import command_line   # experiments/, beside this file
from s24jax.cli import compare

SR_STE = "experiments/gpt2_sr_ste.py:tiny"
RECIPE = "experiments/gpt2_t_sr_ste_df.py:tiny"

def _auto(method: str) -> dict:
  """lambda_W adjusted by the warm-up controller during steps [100, 200), from the experiment
  file's decay (the paper's)."""
  return {f"sparsity.{method}.decay_auto": True, f"sparsity.{method}.decay_auto_steps": 200}


RUNS = [
    compare.Arm("dense", "experiments/gpt2_dense.py:tiny"),
    compare.Arm("ste", "experiments/gpt2_ste.py:tiny"),
    compare.Arm("sr_ste_grad", SR_STE, {"sparsity.sr_ste.decay": 6e-5,
                                            "sparsity.sr_ste.decay_placement": "gradients"}),
    compare.Arm("sr_ste_weights", SR_STE, {"sparsity.sr_ste.decay": 6e-5,
                                               "sparsity.sr_ste.decay_placement": "weights"}),
    compare.Arm("recipe", RECIPE),
    compare.Arm("sr_ste_grad_auto", SR_STE, {**_auto("sr_ste"),
                                                 "sparsity.sr_ste.decay_placement": "gradients"}),
    compare.Arm("recipe_auto", RECIPE, _auto("t_sr_ste")),
    # Ablations of the recipe: what MVUE and the 40-step mask refresh cost.
    compare.Arm("recipe_no_mvue", RECIPE, {"sparsity.mvue": False}),
    compare.Arm("recipe_refresh1", RECIPE, {"sparsity.t_sr_ste.mask_refresh_every": 1}),
    compare.Arm("recipe_refresh40", RECIPE, {"sparsity.t_sr_ste.mask_refresh_drift": 0.0}),
]

EXTRA = {"train/method/decay": "lambda", "train/transposable_kept_ratio": "kept_ratio",
         "train/mask_refresh/refreshed": "refresh", "train/flip_rate_warning": "flip_warn"}


def main(argv=None) -> int:
  description = __doc__.split("\n")[0]
  parsed = command_line.comparison_parser(description, [r.name for r in RUNS],
                                          "runs/compare_hu2024", prog=NAME).parse_args(argv)
  command_line.compare(parsed, RUNS, description, extra_keys=EXTRA)
  return 0


if __name__ == "__main__":
  from s24jax.kernels import aot   # pylint: disable=g-import-not-at-top
  aot.cpu_unless_gpu()
  command.exit_with(command.run(main, name=NAME, stopped=command_line.STOPPED))
