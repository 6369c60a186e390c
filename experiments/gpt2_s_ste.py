"""2:4 FFN weights with S-STE: soft threshold, per-tensor scale fixed at init (Hu, Zhu, Chen 2024).

  python launch.py --config experiments/gpt2_s_ste.py:tiny --workdir runs/demo

Expected (tiny, 2 CPU cores, a few minutes): final val loss clearly below the unigram entropy
of the embedded corpus, close to the dense baseline; the flip rate rises early then decays.
The default (no variant) is the paper-scale GPT-2 124M recipe of DESIGN.md section 6.
"""
from s24jax.config import apply_variant, base_config


def get_config(variant=None):
  config = base_config()
  config.sparsity.projection = "s_ste"
  return apply_variant(config, variant)
