"""MST vs dense GPT-2 at equal steps: final val loss and total training FLOPs.

  python experiments/compare_mst.py [--variant tiny] [--steps N] [--root runs/compare_mst]

Runs experiments/gpt2_dense.py, experiments/gpt2_mst.py (Hybrid Sparse Attention: strided
during the middle half) and the same MST without sparse attention, each in its own workdir
under --root (finished runs are reused), and prints a markdown table: val/train loss, the
run's total training FLOPs (s24jax/flops.py), the reduction factor against the dense run
(dense FLOPs / run FLOPs), and the same factor without the dense lm head. The MST workdirs
get mst_schedule.png (target sparsity per phase, drop fraction, attention window, and the
sparsity measured after every topology update).

Expected (tiny): MST's val loss near dense; far fewer FLOPs without the head than in total,
because the tiny model's 50k-vocabulary lm head dominates its FLOPs. The 124m plan
(`python -m s24jax.flops experiments/gpt2_mst.py:124m`) is the paper-scale number. Measured:
README, "Mixed Sparsity Training".
"""
from __future__ import annotations

import argparse
import os

from s24jax import compare

FLOP_KEYS = ("flops_total", "flops_reduction", "flops_reduction_no_head")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--variant", default="tiny")
  parser.add_argument("--steps", type=int, default=0, help="override total_steps (0: keep)")
  parser.add_argument("--root", default="runs/compare_mst")
  args = parser.parse_args()
  common = {"total_steps": args.steps} if args.steps else {}
  if args.steps:   # keep a few evaluations in a shortened run
    common["eval_every"] = max(1, args.steps // 4)
  runs = [
      compare.Run("dense", f"experiments/gpt2_dense.py:{args.variant}", dict(common)),
      compare.Run("mst", f"experiments/gpt2_mst.py:{args.variant}", dict(common)),
      compare.Run("mst_no_sparse_attention", f"experiments/gpt2_mst.py:{args.variant}",
                  {**common, "sparsity.mst.sparse_attention": "causal"}),
  ]
  table = compare.run_all(runs, args.root, extra_keys=FLOP_KEYS)
  print(table)
  with open(os.path.join(args.root, "table.md"), "w", encoding="utf-8") as f:
    f.write(table + "\n")
  print(f"schedule plot: {os.path.join(args.root, 'mst', 'mst_schedule.png')}")


if __name__ == "__main__":
  main()
