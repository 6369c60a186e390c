"""Every 2:4 recipe against dense at equal steps, over seeds and two corpora (tiny GPT-2).

  python experiments/compare_recipes.py [--root runs/recipes] [--seeds 0,1,2]
      [--corpus shakespeare,pystdlib] [--only dense,s_ste,...]

Runs each recipe's tiny variant (600 steps) once per seed (`config.seed`: init, batch order,
MVUE draws) on the embedded corpus and on the Python standard library's source
(experiments/pystdlib_corpus.py; never used for tuning), each in its own workdir under
--root (finished runs are reused), and prints per corpus: final val loss as mean ± sd over
the seeds, and the gap to dense as mean ± sd of the per-seed relative gaps (relu2 recipes
also against relu2 dense). Extra columns for the decisions of issue 12: the train-loss jump
at the switch to dense fine-tuning (first dense log minus last sparse log) and MVUE's
measured share of the forward/backward time.

Runs:
  dense, relu2_dense             the baselines (GELU; Squared-ReLU for the V:N:M recipe)
  ste, sr_ste                    hard threshold; + masked decay (experiments/gpt2_sr_ste.py)
  s_ste                          the S-STE recipe as configured (experiments/gpt2_s_ste.py)
  s_ste_no_mvue                  ... with the exact weight gradient
  hu2024                         the Hu et al. recipe as configured (gpt2_t_sr_ste_df.py)
  hu2024_refresh40               ... with the paper's fixed 40-step mask refresh
  hu2024_projected               ... with dense fine-tuning from W~ instead of the latent W
  hu2024_no_mvue                 ... with the exact weight gradient
  venom                          Haziza et al. (experiments/gpt2_venom.py)
Measured tables: README ("Tiny comparisons over seeds").
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from s24jax import config_files
from s24jax import metrics as metrics_lib
from s24jax.methods import base as methods_base

import pystdlib_corpus  # pylint: disable=wrong-import-order  (experiments/, beside this file)

T = "experiments/gpt2_{}.py:tiny"
RECIPES = {
    "dense": (T.format("dense"), {}),
    "relu2_dense": (T.format("relu2_dense"), {"act_sparsity.stats_sequences": 0}),
    "ste": (T.format("ste"), {}),
    "sr_ste": (T.format("sr_ste"), {}),
    "s_ste": (T.format("s_ste"), {}),
    "s_ste_no_mvue": (T.format("s_ste"), {"sparsity.mvue": False}),
    "hu2024": (T.format("t_sr_ste_df"), {}),
    "hu2024_refresh40": (T.format("t_sr_ste_df"), {"sparsity.t_sr_ste.mask_refresh_drift": 0.0}),
    "hu2024_projected": (T.format("t_sr_ste_df"), {"sparsity.dense_finetune_init": "projected"}),
    "hu2024_no_mvue": (T.format("t_sr_ste_df"), {"sparsity.mvue": False}),
    "venom": (T.format("venom"), {"act_sparsity.stats_sequences": 0}),
}
BASELINE = {"relu2_dense": None, "venom": "relu2_dense"}   # default: against 'dense'


def run_one(name: str, seed: int, corpus: str, root: str, corpus_dir: str) -> str:
  spec, overrides = RECIPES[name]
  workdir = os.path.join(root, corpus, f"{name}_seed{seed}")
  if not os.path.exists(os.path.join(workdir, "final_metrics.json")):
    from s24jax import loop   # pylint: disable=g-import-not-at-top
    data = {} if corpus == "shakespeare" else {"data.path": corpus_dir, "data.name": "text_folder"}
    config = config_files.load_config(spec, {**overrides, **data, "seed": seed})
    print(f"== {corpus} {name} seed {seed}", flush=True)
    loop.train_and_evaluate(config, workdir)
  return workdir


def summary(workdir: str, spec: str, overrides: dict) -> dict[str, float]:
  with open(os.path.join(workdir, "final_metrics.json"), encoding="utf-8") as f:
    final = json.load(f)
  out = {"val": final["val/loss"], "mvue_share": final.get("perf/mvue_time_share")}
  cfg = config_files.load_config(spec, overrides)
  start = methods_base.dense_finetune_start(cfg)
  if start < cfg.total_steps:   # the train-loss jump at the switch to dense fine-tuning
    steps, loss = metrics_lib.series(metrics_lib.read_jsonl(
        os.path.join(workdir, "metrics.jsonl")), "train/loss")
    before, after = loss[steps <= start][-1], loss[steps > start][0]
    out["jump"] = float(after - before)
  return out


def _pm(xs, fmt="{:.3f}") -> str:
  xs = [x for x in xs if x is not None]
  if not xs:
    return "-"
  if len(xs) == 1:
    return fmt.format(xs[0])
  return fmt.format(np.mean(xs)) + " ± " + fmt.replace("+", "").format(np.std(xs, ddof=1))


def table(root: str, corpus: str, names, seeds) -> str:
  """Mean ± sd over the finished seeds of each run (the n column says how many)."""
  def finished(n, s):
    return os.path.exists(os.path.join(root, corpus, f"{n}_seed{s}", "final_metrics.json"))
  rows = {n: {s: summary(os.path.join(root, corpus, f"{n}_seed{s}"), *RECIPES[n])
              for s in seeds if finished(n, s)} for n in names}
  lines = [f"**{corpus}**", "",
           "| run | n | val loss | vs baseline (paired by seed) | baseline | "
           "jump at dense switch | MVUE time share |",
           "|---|---|---|---|---|---|---|"]
  for n in names:
    if not rows[n]:
      continue
    base = BASELINE.get(n, "dense")
    gap = "-"
    if base and base in rows and base != n:
      gaps = [100 * (r["val"] / rows[base][s]["val"] - 1) for s, r in rows[n].items()
              if s in rows[base]]
      gap = _pm(gaps, "{:+.2f}") + " %" if gaps else "-"
    vals = list(rows[n].values())
    lines.append(f"| {n} | {len(vals)} | {_pm([r['val'] for r in vals])} | {gap} | "
                 f"{base or '-'} | {_pm([r.get('jump') for r in vals])} | "
                 f"{_pm([r.get('mvue_share') for r in vals], '{:.2f}')} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--root", default="runs/recipes")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--corpus", default="shakespeare,pystdlib")
  p.add_argument("--only", default="")
  args = p.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  names = args.only.split(",") if args.only else list(RECIPES)
  unknown = sorted(set(names) - set(RECIPES))
  if unknown:
    raise SystemExit(f"unknown runs {unknown}; valid: {', '.join(RECIPES)}")
  corpus_dir = pystdlib_corpus.prepare(os.path.join(args.root, "corpora", "pystdlib"))
  out = []
  for corpus in args.corpus.split(","):
    for seed in seeds:          # seed-major: every recipe gets one seed before any gets three
      for name in names:
        run_one(name, seed, corpus, args.root, corpus_dir)
    out.append(table(args.root, corpus, names, seeds))
  text = "\n\n".join(out)
  print(text)
  with open(os.path.join(args.root, "table.md"), "w", encoding="utf-8") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
