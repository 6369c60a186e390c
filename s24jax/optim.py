"""The optimizer: clipped AdamW with SR-STE's masked decay in either Adam placement.

Masked decay adds lambda_W * (1 - m(W)) * W for every sparse kernel W (DESIGN.md section 4):
- 'gradients' (Hu et al. 2024): after clipping, before Adam, so it enters Adam's moments;
- 'weights' (original SR-STE, decoupled): after Adam, next to weight decay, scaled by lr;
- 'backward': inside the projection's backward rule (`projections.sr_ste24`), before clipping.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from s24jax import schedules


class MaskedDecayState(NamedTuple):
  pass


def add_masked_decay(decay: float | Callable[[Any], jax.Array],
                     is_sparse: Any,
                     mask_fn: Callable[[jax.Array], jax.Array]) -> optax.GradientTransformation:
  """updates += decay * (1 - mask_fn(W)) * W on the leaves where `is_sparse` is True.

  `is_sparse` is a pytree of bools with the structure of the params; `decay` a float or a
  function of the optimizer step count (lets a later stage choose it during warm-up).
  """

  def init_fn(params):
    del params
    return MaskedDecayState()

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("add_masked_decay needs the params")
    lam = decay if not callable(decay) else decay(state)

    def one(u, w, sparse):
      if not sparse:
        return u
      pruned = jnp.where(mask_fn(w), 0, w)
      return u + (lam * pruned).astype(u.dtype)

    return jax.tree.map(one, updates, params, is_sparse), state

  return optax.GradientTransformation(init_fn, update_fn)


def is_matrix(params) -> Any:
  """Weight decay only on matrices (kernels, embeddings), not on biases and norms."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config, is_sparse: Any,
                   mask_fn: Callable[[jax.Array], jax.Array]) -> optax.GradientTransformation:
  """AdamW with warm-up + cosine lr, clipping, and the configured masked-decay placement."""
  o, s = config.optim, config.sparsity
  lr = schedules.learning_rate(o, config.total_steps)
  use_decay = s.projection == "sr_ste" and s.decay > 0
  decay = lambda placement: ([add_masked_decay(s.decay, is_sparse, mask_fn)]
                             if use_decay and s.decay_placement == placement else [])
  return optax.chain(
      optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity(),
      *decay("gradients"),
      optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
      optax.add_decayed_weights(o.weight_decay, mask=is_matrix),
      *decay("weights"),
      optax.scale_by_learning_rate(lr),
  )
