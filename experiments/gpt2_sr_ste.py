"""2:4 FFN weights with SR-STE masked decay, on gradients before Adam (Hu et al. 2024).

  python launch.py --config experiments/gpt2_sr_ste.py:tiny --workdir runs/sr_ste_tiny
  # the original decoupled placement (on weights):
  python launch.py --config experiments/gpt2_sr_ste.py:tiny --config.sparsity.decay_placement=weights

lambda_W = 6e-5 (GPT-2 124M/774M; the 350m/1558m variants use 2e-4, Hu et al.). Expected
(tiny): a lower flip rate than plain STE late in training, val loss near STE or better.
"""
from s24jax.config import apply_variant, base_config


def get_config(variant=None):
  config = base_config()
  config.sparsity.projection = "sr_ste"
  config.sparsity.decay = 6e-5
  config.sparsity.decay_placement = "gradients"
  return apply_variant(config, variant)
