"""The Squared-ReLU dense baseline: the Llama-style model with a two-matrix relu^2 FFN (up,
down) instead of SwiGLU, as Haziza et al. 2026 pre-train it.

  python launch.py --config experiments/llama_relu2_dense.py:small --workdir runs/llama_relu2_dense_small

The recipe is experiments/gpt2_relu2_dense.py's, run with model.family='llama' (s24jax/nn/llama.py);
variants: tiny, small (the CPU test bed), 125m (default), 1b, 7b (s24jax/training/config.py,
LLAMA_SIZES). Measured: docs/results.md, "The Llama-style family".
"""
from s24jax.config_files import sibling_config


def get_config(variant=None):
  return sibling_config(__file__, "gpt2_relu2_dense", variant, family="llama")
