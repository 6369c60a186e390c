"""Dense GPT-2 with a Squared-ReLU FFN, relu(x)^2: the baseline of the Haziza et al. recipe.

  python launch.py --config experiments/gpt2_relu2_dense.py:tiny --workdir runs/relu2_dense_tiny

Logs the natural sparsity of the FFN activations every log step (`act/zero_frac/<layer>`:
exact zeros; `act/kept_l1/<layer>`: the share of L1 magnitude a V=64, 2:8 mask would keep)
and plots them in the third panel of metrics.png. Expected (tiny): val loss a little below
the GELU baseline; about half the activations exactly zero at init (relu of a symmetric
pre-activation), more at the end; a 2:8 V:N:M mask keeps most of their L1 magnitude (GELU:
about half). Measured: docs/results.md, "Activation sparsity". Variants: tiny, 124m (default), 350m,
774m, 1558m.
"""
from s24jax.training.config import CPU_VARIANTS
from s24jax.training.config import apply_variant
from s24jax.training.config import base_config


def get_config(variant=None, family="gpt2"):
  config = base_config(family)
  config.model.activation = "relu2"
  config.sparsity.method = "dense"
  config = apply_variant(config, variant)
  config.act_sparsity.stats_sequences = 16 if variant in CPU_VARIANTS else 8
  return config
