"""The dense baseline on the Llama-style model (SwiGLU FFN of three matrices, grouped-query
attention, RoPE, RMSNorm, untied embeddings).

  python launch.py --config experiments/llama_dense.py:small --workdir runs/llama_dense_small

The recipe is experiments/gpt2_dense.py's, run with model.family='llama' (s24jax/nn/llama.py);
variants: tiny, small (the CPU test bed), 125m (default), 1b, 7b (s24jax/training/config.py,
LLAMA_SIZES). Measured: docs/results.md, "The Llama-style family".
"""
from s24jax.config_files import sibling_config


def get_config(variant=None):
  return sibling_config(__file__, "gpt2_dense", variant, family="llama")
