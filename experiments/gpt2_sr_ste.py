"""2:4 FFN weights with SR-STE masked decay, on gradients before Adam (Hu et al. 2024).

  python launch.py --config experiments/gpt2_sr_ste.py:tiny --workdir runs/sr_ste_tiny
  # the original decoupled placement (on weights):
  python launch.py --config experiments/gpt2_sr_ste.py:tiny \\
      --config.sparsity.sr_ste.decay_placement=weights

lambda_W per model size from Hu et al. (methods.sr_ste.PAPER_DECAY: 6e-5 at 124M/774M, 2e-4 at
350M/1.5B; tiny uses the 124M value). Expected (tiny): a lower flip rate than plain STE late
in training, val loss near STE. Measured: docs/results.md, "Hu et al. 2024".
"""
from s24jax.training.config import apply_variant
from s24jax.training.config import base_config
from s24jax.methods import sr_ste


def get_config(variant=None, family="gpt2"):
  config = base_config(family)
  config.sparsity.method = "sr_ste"
  config.sparsity.sr_ste.decay = sr_ste.PAPER_DECAY.get(variant, sr_ste.PAPER_DECAY["124m"])
  config.sparsity.sr_ste.decay_placement = "gradients"
  return apply_variant(config, variant)
