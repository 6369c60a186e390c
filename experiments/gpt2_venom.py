"""Haziza et al. (2025, 2026): Squared-ReLU FFN, V:N:M-sparse activations, 2:4 weights,
sparse then dense.

  python launch.py --config experiments/gpt2_venom.py:tiny --workdir runs/venom_tiny
  python launch.py --config experiments/gpt2_venom.py:124m --workdir runs/venom_124m
  # activations only (dense weights):
  python launch.py --config experiments/gpt2_venom.py:tiny --config.sparsity.method=dense

The FFN is relu(x W1~^T)^2 W2~^T with both FFN weights 2:4 soft-thresholded (S-STE, fixed
scale) and the hidden activations that feed the second matmul made V:N:M sparse
(V=64 token rows, 2:8 along the hidden axis: 75% zeros; straight-through gradient on the
kept entries). The first 70% of the steps train that way, the last 30% dense: the dense twin
without weight or activation sparsity, from the projected weights beta S(W). The activation
statistics (exact zeros, V:N:M kept L1 share) are logged per layer every log step and
plotted in metrics.png.

Expected (tiny): val loss a little above the relu2 dense baseline
(experiments/gpt2_relu2_dense.py); training with the mask makes the activations more
V:N:M-friendly (the kept L1 share rises). Measured: docs/results.md, "Activation sparsity"
(experiments/compare_venom.py). On a GPU host --config.act_sparsity.backend=pallas selects and
multiplies with kernels/venom.py (never run natively: no GPU in this project).
"""
from s24jax.training.config import CPU_VARIANTS
from s24jax.training.config import apply_variant
from s24jax.training.config import base_config


def get_config(variant=None, family="gpt2"):
  config = base_config(family)
  config.model.activation = "relu2"
  config.sparsity.method = "s_ste"
  config.sparsity.sparse_layers = ("*/mlp/*",)   # both FFN matrices (fc, proj / up, down)
  config.act_sparsity.kind = "venom"
  config.act_sparsity.v = 64
  config.act_sparsity.n = 2
  config.act_sparsity.m = 8
  config.sparsity.dense_finetune_fraction = 0.3   # 70% sparse, then dense
  # The dense phase starts from the weights the forward used, beta S(W), not the latent W:
  # with S-STE weights the latent W is another function (scale beta ~1.48, no threshold
  # shift), and starting from it cost val loss on small (docs/results.md, "What the papers claim":
  # the venom_latent rows).
  config.sparsity.dense_finetune_init = "projected"
  config = apply_variant(config, variant)
  config.act_sparsity.stats_sequences = 16 if variant in CPU_VARIANTS else 8
  return config
