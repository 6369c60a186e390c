"""The optimizer: clipped AdamW, with the method's transforms at their placements.

    clip -> [method: 'gradients'] -> Adam -> weight decay (matrices) -> [method: 'weights'] -> lr

A method inserts transforms at either placement (`Method.optimizer_transforms`), e.g. SR-STE's
masked decay after clipping and before Adam (Hu et al. 2024) or decoupled after Adam, and
supplies their per-step extra arguments from the train state (`Method.optimizer_args`).
"""
from __future__ import annotations

from typing import Any

import jax
import optax

from s24jax import schedules


def is_matrix(params) -> Any:
  """Weight decay only on matrices (kernels, embeddings), not on biases and norms."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config, is_sparse: Any, method) -> optax.GradientTransformationExtraArgs:
  """AdamW with warm-up + cosine lr, clipping, and `method`'s transforms; `is_sparse` is a
  params-shaped bool tree marking the sparse kernels."""
  o = config.optim
  lr = schedules.learning_rate(o, config.total_steps)
  return optax.with_extra_args_support(optax.chain(
      optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity(),
      *method.optimizer_transforms("gradients", is_sparse),
      optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
      optax.add_decayed_weights(o.weight_decay, mask=is_matrix),
      *method.optimizer_transforms("weights", is_sparse),
      optax.scale_by_learning_rate(lr),
  ))
