"""Every 2:4 recipe against its dense baseline at equal steps, over seeds and corpora.

  python experiments/compare_recipes.py --jobs 2            # the README's tables (small)
  python experiments/compare_recipes.py --only dense,s_ste --seeds 0,1,2 \\
      --corpus shakespeare,mine=/path/to/txt_folder          # your own corpus: a .txt folder

Runs each recipe's `--variant` (default `small`: 4 layers, width 128, UTF-8 bytes; the FFN is
59% of the training FLOPs) once per seed (`config.seed`: init, batch order, MVUE draws), each
through `launch.py` in its own workdir under --root/steps<N> (N: the run length; finished
runs are reused, so the script can be stopped and re-run), `--jobs` at a time, each job pinned
to its own CPU core (one XLA thread: two jobs use two cores better than one job with two
threads). Corpora: the embedded
Shakespeare, the Python standard library's source (experiments/pystdlib_corpus.py; never used
for tuning), or NAME=FOLDER (a folder of .txt files, one document per file). The ablations run
on the first corpus only.

The table (printed, and written to --root/table.md) gives per corpus and recipe the final
val loss (mean ± sd over seeds) and the gap to the recipe's baseline as mean ± sd of the
per-seed relative gaps (run and baseline share the seed: init, batches and data order), plus
the train-loss jump at the switch to dense fine-tuning, MVUE's measured share of the step time,
and the minutes per run on one core. Measured tables: README, "Results on the small config".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from s24jax import config_files
from s24jax import metrics as metrics_lib
from s24jax import phases
from s24jax.methods import base as methods_base

import gpt2_mst  # pylint: disable=wrong-import-order  (experiments/, beside this file)
import pystdlib_corpus  # pylint: disable=wrong-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name -> (experiment file stem, overrides). The recipes run on every corpus.
RECIPES = {
    "dense": ("dense", {}),
    "ste": ("ste", {}),
    "sr_ste": ("sr_ste", {}),
    "s_ste": ("s_ste", {}),
    "hu2024": ("t_sr_ste_df", {}),
    "relu2_dense": ("relu2_dense", {"act_sparsity.stats_sequences": 0}),
    "venom": ("venom", {"act_sparsity.stats_sequences": 0}),
}
# Ablations and follow-ups: the first corpus only.
ABLATIONS = {   # in the order they run (seed-major): the last ones are cut first
    "s_ste_no_mvue": ("s_ste", {"sparsity.mvue": False}),
    "s_ste_no_fp8": ("s_ste", {"sparsity.fp8": False}),
    "sr_ste_weights": ("sr_ste", {"sparsity.sr_ste.decay_placement": "weights"}),
    "mst_head_dense": ("mst", {"sparsity.sparse_layers": ("*/attn/*", "*/mlp/*")}),
    "hu2024_auto": ("t_sr_ste_df", {"sparsity.t_sr_ste.decay_auto": True}),
    "mst": ("mst", {}),
    "s_ste_e5m2_bwd": ("s_ste", {"sparsity.fp8_backward_operands": "e5m2"}),
    "venom_latent": ("venom", {"act_sparsity.stats_sequences": 0,
                               "sparsity.dense_finetune_init": "latent"}),
    "s_ste_rescale200": ("s_ste", {"sparsity.s_ste.rescale_every": 200}),
    "hu2024_no_mvue": ("t_sr_ste_df", {"sparsity.mvue": False}),
    "mst_head_dense_causal": ("mst", {"sparsity.sparse_layers": ("*/attn/*", "*/mlp/*"),
                                      "sparsity.mst.sparse_attention": "causal"}),
    "mst_ffn_only": ("mst", {"sparsity.sparse_layers": ("*/mlp/*",),
                             "sparsity.mst.sparse_attention": "causal"}),
    # Strided attention alone (the experiment file's local ∪ strided without the local part):
    # each query sees every l-th earlier position only, not the previous one.
    "mst_head_dense_strided": ("mst", {"sparsity.sparse_layers": ("*/attn/*", "*/mlp/*"),
                                       "sparsity.mst.sparse_attention": "strided"}),
}
# Follow-ups (README, "What the papers claim"): the flip-rate regime at twice the lr.
LR2X = {"optim.lr": 4e-3, "optim.min_lr": 4e-4}
ABLATIONS.update({f"{n}_lr2x": (RECIPES[n][0], LR2X) for n in ("dense", "ste", "sr_ste", "s_ste")})
# S-STE's forward is beta S(W) with beta ~1.48 frozen: does an lr / beta close its gap to STE?
LR_BY_BETA = {"optim.lr": 1.35e-3, "optim.min_lr": 1.35e-4}
ABLATIONS.update({f"{n}_lr067": (RECIPES[n][0], LR_BY_BETA) for n in ("ste", "s_ste")})
# Weight decay on the latent W (0.1 on every matrix by default): S-STE against STE without it.
ABLATIONS.update({f"{n}_wd0": (RECIPES[n][0], {"optim.weight_decay": 0.0}) for n in ("ste", "s_ste")})
# MST's control at its FLOPs: dense at width 64 plans 1/4 of the blocks' matmul FLOPs of width
# 128 (MST's blocks: ~4x fewer) with 1/4 of their parameters (MST's end: 0.3 dense).
ABLATIONS["dense_w64"] = ("dense", {"model.d_model": 64})
RUNS = {**RECIPES, **ABLATIONS}
BASELINE = {"relu2_dense": None, "venom": "relu2_dense",   # default: against 'dense'
            "venom_latent": "relu2_dense",
            **{f"{n}_lr2x": "dense_lr2x" for n in ("ste", "sr_ste", "s_ste")}}
# What each ablation changes: its paired gap to that recipe is the ablation's effect.
ABLATES = {"sr_ste_weights": "sr_ste", "s_ste_no_mvue": "s_ste", "s_ste_no_fp8": "s_ste",
           "s_ste_e5m2_bwd": "s_ste", "mst_head_dense": "mst", "hu2024_auto": "hu2024",
           "venom_latent": "venom", "s_ste_rescale200": "s_ste", "hu2024_no_mvue": "hu2024",
           "mst_head_dense_causal": "mst_head_dense", "mst_ffn_only": "mst_head_dense",
           "mst_head_dense_strided": "mst_head_dense"}
ABLATES["s_ste_lr067"] = "ste_lr067"   # paired at the same lower lr
ABLATES["s_ste_wd0"] = "ste_wd0"
ABLATES["dense_w64"] = "mst_head_dense"   # the small dense model against MST at its FLOPs
EMBEDDED = "shakespeare"


def corpus_overrides(corpus: str, root: str) -> tuple[str, dict]:
  """(label, config.data overrides) of 'shakespeare', 'pystdlib' or 'NAME=FOLDER'."""
  if corpus == EMBEDDED:
    return corpus, {}
  if corpus == "pystdlib":
    folder = pystdlib_corpus.prepare(os.path.join(root, "corpora", "pystdlib"))
    return corpus, {"data.name": "text_folder", "data.path": os.path.abspath(folder)}
  name, sep, folder = corpus.partition("=")
  if not sep or not os.path.isdir(folder):
    raise SystemExit(f"unknown corpus {corpus!r}: give 'shakespeare', 'pystdlib' or "
                     "NAME=FOLDER (a folder of .txt files)")
  return name, {"data.name": "text_folder", "data.path": os.path.abspath(folder)}


def run_config(name: str, variant: str) -> tuple[str, dict]:
  stem, overrides = RUNS[name]
  return f"experiments/gpt2_{stem}.py:{variant}", overrides


def variant_steps(variant: str) -> int:
  """The variant's own run length (every experiment file keeps it)."""
  spec, overrides = run_config("dense", variant)
  return config_files.load_config(os.path.join(ROOT, spec), overrides).total_steps


def workdir_of(root: str, corpus: str, name: str, seed: int) -> str:
  return os.path.join(root, corpus, f"{name}_seed{seed}")


def finished(workdir: str) -> bool:
  return os.path.exists(os.path.join(workdir, "final_metrics.json"))


def _flag(key: str, value) -> str:
  if isinstance(value, tuple):
    value = "(" + ",".join(repr(v) for v in value) + ",)"
  return f"--config.{key}={value}"


def length_overrides(name: str, steps: int) -> dict:
  """Overrides that run `name` for `steps` steps, its schedules stretched alike."""
  if not steps:
    return {}
  # The cosine decay, the phases (dense fine-tuning, MST's levels) are fractions of total_steps
  # and stretch; the lr warm-up is a step count (60 on small) and stays. MST's Delta is set by
  # its experiment file from total_steps, so it is stretched here.
  if RUNS[name][0] == "mst":
    return {"total_steps": steps,
            "sparsity.mst.update_every": steps // gpt2_mst.CPU_UPDATES_PER_RUN}
  return {"total_steps": steps}


def launch_command(name: str, seed: int, variant: str, data: dict, workdir: str,
                   steps: int = 0) -> list[str]:
  spec, overrides = run_config(name, variant)
  overrides = {**overrides, **length_overrides(name, steps)}
  flags = [_flag(k, v) for k, v in {**overrides, **data, "seed": seed}.items()]
  return [sys.executable, os.path.join(ROOT, "launch.py"), "--config", spec,
          "--workdir", workdir, *flags]


def run_all(jobs: list[tuple[list[str], str]], parallel: int) -> None:
  """Runs the launch commands, `parallel` at a time, job i pinned to core i % cores."""
  cores = sorted(os.sched_getaffinity(0))
  free = list(range(min(parallel, len(cores))))
  running: list[tuple[subprocess.Popen, int, str, float]] = []
  pending = list(jobs)
  while pending or running:
    while pending and free:
      cmd, workdir = pending.pop(0)
      slot = free.pop(0)
      os.makedirs(workdir, exist_ok=True)
      log = open(os.path.join(workdir, "launch.out"), "w", encoding="utf-8")  # pylint: disable=consider-using-with
      core = cores[slot % len(cores)]
      proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              preexec_fn=lambda c=core: os.sched_setaffinity(0, {c}))
      print(f"[core {core}] {workdir}", flush=True)
      running.append((proc, slot, workdir, time.time()))
    time.sleep(2)
    for item in list(running):
      proc, slot, workdir, start = item
      if proc.poll() is None:
        continue
      running.remove(item)
      free.append(slot)
      minutes = (time.time() - start) / 60
      status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
      print(f"{status} in {minutes:.1f} min: {workdir}", flush=True)
      if proc.returncode == 0:
        with open(os.path.join(workdir, "wall_minutes.txt"), "w", encoding="utf-8") as f:
          f.write(f"{minutes:.2f}\n")


def summary(workdir: str, name: str, variant: str, steps: int = 0) -> dict[str, float]:
  with open(os.path.join(workdir, "final_metrics.json"), encoding="utf-8") as f:
    final = json.load(f)
  out = {"val": final["val/loss"], "mvue_share": final.get("perf/mvue_time_share")}
  wall = os.path.join(workdir, "wall_minutes.txt")
  if os.path.exists(wall):
    with open(wall, encoding="utf-8") as f:
      out["minutes"] = float(f.read())
  spec, overrides = run_config(name, variant)
  cfg = config_files.load_config(spec, {**overrides, **length_overrides(name, steps)})
  start = phases.dense_finetune_start(methods_base.RunFacts.from_config(cfg))
  if start < cfg.total_steps:   # the train-loss jump at the switch to dense fine-tuning
    logged, loss = metrics_lib.series(metrics_lib.read_jsonl(
        os.path.join(workdir, "metrics.jsonl")), "train/loss")
    before, after = loss[logged <= start][-1], loss[logged > start][0]
    out["jump"] = float(after - before)
  return out


def mean_sd(xs, fmt="{:.3f}") -> str:
  xs = [x for x in xs if x is not None]
  if not xs:
    return "-"
  if len(xs) == 1:
    return fmt.format(xs[0])
  return fmt.format(np.mean(xs)) + " ± " + fmt.replace("+", "").format(np.std(xs, ddof=1))


def paired_gaps(rows: dict, name: str, base: str) -> list[float]:
  """100 (val / baseline val - 1) per seed both finished."""
  return [100 * (r["val"] / rows[base][s]["val"] - 1) for s, r in rows[name].items()
          if s in rows.get(base, {})]


def table(root: str, corpus: str, names, seeds, variant: str, steps: int = 0) -> str:
  """Mean ± sd over the finished seeds of each run (the n column says how many)."""
  needed = list(dict.fromkeys([*names, "dense", *(BASELINE.get(n) or "dense" for n in names),
                               *(ABLATES[n] for n in names if n in ABLATES)]))
  rows = {n: {s: summary(workdir_of(root, corpus, n, s), n, variant, steps)
              for s in seeds if finished(workdir_of(root, corpus, n, s))} for n in needed}
  length = f", {steps} steps" if steps else ""
  lines = [f"**{corpus}** ({variant}{length})", "",
           "| run | n | val loss | gap to baseline (paired by seed) | baseline | "
           "vs the recipe it ablates | jump at dense switch | MVUE time share | "
           "min/run (1 core) |",
           "|---|---|---|---|---|---|---|---|---|"]
  for n in names:
    if not rows[n]:
      continue
    base = BASELINE.get(n, "dense")
    gap = "-"
    if base and base != n:
      gaps = paired_gaps(rows, n, base)
      gap = mean_sd(gaps, "{:+.2f}") + " %" if gaps else "-"
    elif n == "dense" or base is None:   # a baseline: its own spread over seeds
      vals = [r["val"] for r in rows[n].values()]
      if len(vals) > 1:
        gap = f"(sd {100 * np.std(vals, ddof=1) / np.mean(vals):.2f} % of the mean)"
    effect = "-"
    if n in ABLATES and paired_gaps(rows, n, ABLATES[n]):
      effect = f"{mean_sd(paired_gaps(rows, n, ABLATES[n]), '{:+.2f}')} % vs {ABLATES[n]}"
    vals = list(rows[n].values())
    lines.append(f"| {n} | {len(vals)} | {mean_sd([r['val'] for r in vals])} | {gap} | "
                 f"{base or '-'} | {effect} | {mean_sd([r.get('jump') for r in vals])} | "
                 f"{mean_sd([r.get('mvue_share') for r in vals], '{:.2f}')} | "
                 f"{mean_sd([r.get('minutes') for r in vals], '{:.1f}')} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
  p.add_argument("--root", default="runs/recipes")
  p.add_argument("--variant", default="small")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--corpus", default="shakespeare,pystdlib")
  p.add_argument("--only", default="", help=f"runs (default: the recipes); valid: "
                 f"{', '.join(RUNS)}")
  p.add_argument("--ablations", action="store_true", help="also the ablations (first corpus)")
  p.add_argument("--jobs", type=int, default=1, help="runs at a time, one core each")
  p.add_argument("--table_only", action="store_true", help="no training: tables of what ran")
  p.add_argument("--steps", type=int, default=0, help="run length (default: the variant's); "
                 "the runs go under --root/steps<N> either way")
  args = p.parse_args(argv)
  # One folder per run length: a finished run of another length is never taken for this one.
  steps = args.steps or variant_steps(args.variant)
  run_root = os.path.join(args.root, f"steps{steps}")
  seeds = [int(s) for s in args.seeds.split(",")]
  names = args.only.split(",") if args.only else list(RECIPES)
  unknown = sorted(set(names) - set(RUNS))
  if unknown:
    raise SystemExit(f"unknown runs {unknown}; valid: {', '.join(RUNS)}")
  corpora = [corpus_overrides(c, args.root) for c in args.corpus.split(",")]
  plan = {label: list(names) for label, _ in corpora}
  if args.ablations:
    plan[corpora[0][0]] += [n for n in ABLATIONS if n not in names]
  jobs = []
  # The baselines first (their spread over seeds says which gaps can be resolved), then the
  # recipes seed-major (each gets one seed on every corpus before any gets two), then the
  # ablations.
  baselines = {n: RECIPES[n] for n in RECIPES if n in BASELINE.values() or n == "dense"}
  groups = (baselines, {n: r for n, r in RECIPES.items() if n not in baselines}, ABLATIONS)
  order = [(seed, label, data, name) for group in groups for seed in seeds
           for label, data in corpora for name in plan[label] if name in group]
  for seed, label, data, name in order:
    workdir = workdir_of(run_root, label, name, seed)
    if not finished(workdir):
      jobs.append((launch_command(name, seed, args.variant, data, workdir, steps),
                   workdir))
  if not args.table_only:
    run_all(jobs, args.jobs)
  text = "\n\n".join(table(run_root, label, plan[label], seeds, args.variant, steps)
                     for label, _ in corpora)
  print(text)
  os.makedirs(run_root, exist_ok=True)
  with open(os.path.join(run_root, "table.md"), "w", encoding="utf-8") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
