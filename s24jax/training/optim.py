"""The optimizer: clipped AdamW, with the method's transforms at their placements.

    [method: 'raw'] -> clip -> [method: 'gradients'] -> Adam -> weight decay (matrices)
        -> [method: 'weights'] -> lr

A method with the `OptimizerTransforms` capability (s24jax/methods/base.py) inserts transforms
at these placements: MST's gradient mask on the raw gradients, SR-STE's masked decay after
clipping and before Adam (Hu et al. 2024) or decoupled after Adam. The train step passes
every transform the same extra arguments: `method` (of the step's model), `sparsity` and
`method_state` (s24jax/training/train.py).
"""
from __future__ import annotations

from typing import Any

import jax
import optax

from s24jax.training import schedules
from s24jax.methods import base

PLACEMENTS = ("raw", "gradients", "weights")


def is_matrix(params) -> Any:
  """Weight decay only on matrices (kernels, embeddings), not on biases and norms."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config, is_sparse: Any, method) -> optax.GradientTransformationExtraArgs:
  """AdamW with warm-up + cosine lr, clipping, and `method`'s transforms; `is_sparse` is a
  params-shaped bool tree marking the sparse kernels."""
  o = config.optim
  lr = schedules.learning_rate(o, config.total_steps)

  def at(placement):
    if isinstance(method, base.OptimizerTransforms):
      return method.optimizer_transforms(placement, is_sparse)
    return []

  return optax.with_extra_args_support(optax.chain(
      *at("raw"),
      optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity(),
      *at("gradients"),
      optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
      optax.add_decayed_weights(o.weight_decay, mask=is_matrix),
      *at("weights"),
      optax.scale_by_learning_rate(lr),
  ))
