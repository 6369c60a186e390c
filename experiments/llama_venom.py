"""Haziza et al. 2026 on the model they publish it on: a Llama-style model with a Squared-ReLU
FFN, S-STE 2:4 weights and V:N:M (64:2:8) activations into the down matrix for 70 % of the
steps, then dense from the projected weights.

  python launch.py --config experiments/llama_venom.py:small --workdir runs/llama_venom_small

The recipe is experiments/gpt2_venom.py's, run with model.family='llama' (s24jax/nn/llama.py);
variants: tiny, small (the CPU test bed), 125m (default), 1b, 7b (s24jax/training/config.py,
LLAMA_SIZES). Measured: docs/results.md, "The Llama-style family".
"""
from s24jax.config_files import sibling_config


def get_config(variant=None):
  return sibling_config(__file__, "gpt2_venom", variant, family="llama")
