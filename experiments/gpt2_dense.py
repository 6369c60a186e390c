"""Dense GPT-2 baseline (the reference every 2:4 method is compared against).

  python launch.py --config experiments/gpt2_dense.py:tiny --workdir runs/dense_tiny

Expected (tiny, 2 CPU cores, ~3 min): final val loss well below the unigram entropy of the
embedded Shakespeare corpus (docs/results.md has the measured numbers). No flip rate: nothing is
sparse. Variants: tiny, 124m (default), 350m, 774m, 1558m.
"""
from s24jax.training.config import apply_variant
from s24jax.training.config import base_config


def get_config(variant=None, family="gpt2"):
  config = base_config(family)
  config.sparsity.method = "dense"
  return apply_variant(config, variant)
