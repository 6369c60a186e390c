"""Mixed Sparsity Training (Hu, Li, Huang) as the authors' code does it: dynamic sparse training
of every linear layer and the tied LM head, with Sparsity Variation and Hybrid Sparse Attention
(docs/algorithms.md, MST; s24jax/methods/mst/).

  python launch.py --config experiments/gpt2_mst.py:tiny --workdir runs/mst_tiny
  python -m s24jax.cli.flops experiments/gpt2_mst.py:124m        # planned FLOPs, no training

Every linear layer of every block (attn qkv/out, mlp fc/proj) and the tied token embedding /
LM head ('wte') are unstructured-sparse with Erdos-Renyi layer sparsities (the head is the
sparsest). Training starts from a random mask at 80% sparsity, holds 90% in the
ultra-sparsification phase (the middle half of the steps) and 70% in the restoration phase
(piecewise constant). Every 100 steps (25 in the tiny variant; never at step 0) the step's
gradient drives a topology update and that step's optimizer update is skipped: each layer
drops its smallest weights (drop fraction 0.3, cosine-annealed) and regrows by gradient
magnitude (3/4) and at random (1/4), just-dropped weights included. Hybrid Sparse Attention:
during the middle half of training each query attends to the l - 1 positions before it and to
every l-th position further back (local ∪ strided: the paper's "strided unfactorized" pattern,
Child et al.'s two strided factors in one mask, the reference code's attn_mode='sparse'); dense
causal attention otherwise. The options that restore our earlier variant (dense head:
sparse_layers without 'wte', dense start, cosine ramps, ...) are listed in docs/algorithms.md.

The workdir gets metrics.png, mst_schedule.png (target sparsity and the sparsity after every
update) and final_metrics.json with the run's training FLOPs against the dense run's
(flops_reduction, and flops_reduction_no_head without the lm head).
Measured: docs/results.md, "Mixed Sparsity Training" (experiments/compare_mst.py and the 124m FLOP
plan). 124m: the paper's setting (seq 1024, l=128).
"""
from s24jax.state import HEADS
from s24jax.training.config import CPU_VARIANTS
from s24jax.training.config import apply_variant
from s24jax.training.config import base_config

CPU_UPDATES_PER_RUN = 24   # topology updates in a CPU run: Delta = total_steps / 24


def get_config(variant=None, family="gpt2"):
  config = base_config(family)
  config.sparsity.method = "mst"
  # The reference's sparse set: every linear layer and the LM head (GPT-2's tied token
  # embedding 'wte', Llama's 'lm_head').
  config.sparsity.sparse_layers = ("*/attn/*", "*/mlp/*", HEADS[family])
  # Not 'strided' alone (q - k a multiple of l): it hides the l - 1 previous positions, the
  # previous token included; on small the val loss then stalls at a bigram model's through the
  # whole middle half (docs/results.md, "What the papers claim": mst_head_dense_strided).
  config.sparsity.mst.sparse_attention = "local_strided"
  config = apply_variant(config, variant)
  config.model.scan_layers = False   # topology updates count weights per (unstacked) layer
  if variant in CPU_VARIANTS:
    # The paper's l = seq_len / 8 (128 of 1024); topology updates every 1/24 of the run.
    config.model.attention_stride = config.model.seq_len // 8
    config.sparsity.mst.update_every = config.total_steps // CPU_UPDATES_PER_RUN
  return config
