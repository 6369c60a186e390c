"""Mixed Sparsity Training on the Llama-style model: every linear layer and the untied LM
head sparse, sparse attention patterns on the rotary attention in the middle half.

  python launch.py --config experiments/llama_mst.py:small --workdir runs/llama_mst_small

The recipe is experiments/gpt2_mst.py's, run with model.family='llama' (s24jax/nn/llama.py);
variants: tiny, small (the CPU test bed), 125m (default), 1b, 7b (s24jax/training/config.py,
LLAMA_SIZES). Measured: docs/results.md, "The Llama-style family".
"""
from s24jax.config_files import sibling_config


def get_config(variant=None):
  return sibling_config(__file__, "gpt2_mst", variant, family="llama")
