"""Hu et al. 2024's full recipe: transposable 2:4 masks, all three GEMMs of every FFN matrix
2:4 sparse with the MVUE weight gradient, then dense fine-tuning for the last 1/6.

  python launch.py --config experiments/llama_t_sr_ste_df.py:small --workdir runs/llama_t_sr_ste_df_small

The recipe is experiments/gpt2_t_sr_ste_df.py's, run with model.family='llama' (s24jax/nn/llama.py);
variants: tiny, small (the CPU test bed), 125m (default), 1b, 7b (s24jax/training/config.py,
LLAMA_SIZES). Measured: docs/results.md, "The Llama-style family".
"""
from s24jax.config_files import sibling_config


def get_config(variant=None):
  return sibling_config(__file__, "gpt2_t_sr_ste_df", variant, family="llama")
