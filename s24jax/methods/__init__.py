"""Sparse-training methods, one module each, behind the interface of `base.Method`.

  dense      no sparsity (and the dense fine-tuning twin of every method)
  ste        hard-threshold 2:4, straight-through
  sr_ste     + SR-STE masked decay, lambda_W fixed or chosen in warm-up
  t_sr_ste   Hu et al. 2024: + a cached transposable mask
  s_ste      S-STE: soft threshold, frozen per-tensor scale
  mst        Mixed Sparsity Training: dynamic unstructured sparsity, sparsity variation,
             hybrid sparse attention

A new method is one module: a `base.Method` subclass and `register_method(name, Method())`.
"""
from s24jax.methods.base import (Method, available_methods, config_blocks, from_config,
                                 get_method, register_method)
from s24jax.methods import dense, ste, sr_ste, t_sr_ste, s_ste, mst  # noqa: F401  (register)

__all__ = ["Method", "available_methods", "config_blocks", "from_config", "get_method",
           "register_method"]
