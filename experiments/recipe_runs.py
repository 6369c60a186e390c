"""The runs of experiments/compare_recipes.py: each recipe and ablation (its experiment file
and overrides), the baseline each is compared with, its config file and overrides for a
variant, seed, corpus and run length, and its workdir.
"""
from __future__ import annotations

import os

from s24jax.training import validate

import gpt2_mst  # pylint: disable=wrong-import-order  (experiments/, beside this file)

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
# Follow-ups (docs/results.md, "What the papers claim"): the flip-rate regime at twice the lr.
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

FAMILIES = ("gpt2", "llama")   # experiments/<family>_<recipe>.py


def run_config(name: str, variant: str, family: str = "gpt2") -> tuple[str, dict]:
  stem, overrides = RUNS[name]   # the file by its absolute path: any working directory
  return os.path.join(ROOT, "experiments", f"{family}_{stem}.py") + f":{variant}", overrides


def variant_steps(variant: str, family: str = "gpt2") -> int:
  """The variant's own run length (every experiment file keeps it); an unknown variant is a
  UserError listing the family's."""
  spec, overrides = run_config("dense", variant, family)
  return validate.load_config(spec, overrides).total_steps


def workdir_of(root: str, corpus: str, name: str, seed: int) -> str:
  return os.path.join(root, corpus, f"{name}_seed{seed}")


def finished(workdir: str) -> bool:
  return os.path.exists(os.path.join(workdir, "final_metrics.json"))


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


def run_overrides(name: str, seed: int, data: dict, steps: int = 0) -> dict:
  """The overrides of a run of `name` on top of its experiment file (run_config's spec)."""
  return {**RUNS[name][1], **length_overrides(name, steps), **data, "seed": seed}
