"""2:4 FFN weights (gate, up, down), hard threshold, straight-through.

  python launch.py --config experiments/llama_ste.py:small --workdir runs/llama_ste_small

The recipe is experiments/gpt2_ste.py's, run with model.family='llama' (s24jax/nn/llama.py);
variants: tiny, small (the CPU test bed), 125m (default), 1b, 7b (s24jax/training/config.py,
LLAMA_SIZES). Measured: docs/results.md, "The Llama-style family".
"""
from s24jax.config_files import sibling_config


def get_config(variant=None):
  return sibling_config(__file__, "gpt2_ste", variant, family="llama")
