"""Haziza et al. (2025, 2026): Squared-ReLU FFN, V:N:M-sparse activations, 2:4 weights,
sparse then dense.

  python launch.py --config experiments/gpt2_venom.py:tiny --workdir runs/venom_tiny
  python launch.py --config experiments/gpt2_venom.py:124m --workdir runs/venom_124m
  # activations only (dense weights):
  python launch.py --config experiments/gpt2_venom.py:tiny --config.sparsity.projection=dense

The FFN is relu(x W1~^T)^2 W2~^T with both FFN weights 2:4 soft-thresholded (S-STE, fixed
scale) and the hidden activations that feed the second matmul made V:N:M sparse
(V=64 token rows, 2:8 along the hidden axis: 75% zeros; straight-through gradient on the
kept entries). The first 70% of the steps train that way, the last 30% dense (weights
projected once, then the dense twin without weight or activation sparsity).
The activation statistics (exact zeros, V:N:M kept L1 share) are logged per layer every
log step and plotted in metrics.png.

Expected (tiny, 600 steps; measured with experiments/compare_venom.py, see its table):
val loss ~5.50 against 5.30 for the relu2 dense baseline; at this scale the 2:4 weights
cost more (~0.13 nats alone) than the V:N:M activations (~0.06 alone), and the short dense
phase (180 steps at the end of the cosine, low lr) recovers little. Training with the mask
makes the activations more V:N:M-friendly: the kept L1 share rises to ~0.93 (dense relu2
run: ~0.86). On CPU a step is ~35% slower than dense relu2 (the V:N:M column search is the
jnp reference).

124m: the paper-scale GPT-2 recipe of DESIGN.md section 6 (300k steps, dense from 210k;
activation statistics on 8 sequences per log step). On a GPU host
--config.sparsity.act_backend=pallas selects and multiplies with kernels/venom.py (forward
from the compressed activations; untested natively here: no GPU in this session).
"""
from s24jax.config import apply_variant, base_config


def get_config(variant=None):
  config = base_config()
  config.model.activation = "relu2"
  config.sparsity.projection = "s_ste"
  config.sparsity.sparse_layers = ("*/mlp/fc", "*/mlp/proj")
  config.sparsity.act_sparsity = "venom"
  config.sparsity.act_v = 64
  config.sparsity.act_n = 2
  config.sparsity.act_m = 8
  config.sparsity.dense_finetune_fraction = 0.3   # 70% sparse, then dense
  config = apply_variant(config, variant)
  config.act_stats_sequences = 16 if variant == "tiny" else 8
  return config
