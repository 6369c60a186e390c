"""2:4 FFN weights, hard threshold, plain straight-through estimator (no decay).

  python launch.py --config experiments/gpt2_ste.py:tiny --workdir runs/ste_tiny

Expected (tiny): trains, val loss a little above dense; the flip rate stays high because
nothing discourages pruned weights from crossing the threshold (what SR-STE fixes).
"""
from s24jax.training.config import apply_variant
from s24jax.training.config import base_config


def get_config(variant=None, family="gpt2"):
  config = base_config(family)
  config.sparsity.method = "ste"
  return apply_variant(config, variant)
