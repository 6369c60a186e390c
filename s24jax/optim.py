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

from s24jax import projections
from s24jax import schedules


class MaskedDecayState(NamedTuple):
  pass


def add_masked_decay(decay: float | Callable[[Any], jax.Array],
                     is_sparse: Any,
                     mask_fn: Callable[[jax.Array], jax.Array]
                     ) -> optax.GradientTransformationExtraArgs:
  """updates += decay * (1 - m(W)) * W on the leaves where `is_sparse` is True.

  `is_sparse` is a pytree of bools with the structure of the params; `decay` a float or a
  function of the optimizer step count. Two optional extra arguments of `update` (optax
  passes them through `optax.chain`) let train_step supply them from the train state:
    decay=lambda: overrides `decay` (the warm-up controller's value, s24jax/decay_control.py;
      0 in the dense fine-tuning phase);
    masks=pytree shaped like the params with the mask the forward pass used at the sparse
      leaves (None elsewhere): m(W) is then that mask instead of mask_fn(W). This matters for
      projections with a cached mask (t_sr_ste), whose forward mask is not mask_fn(W) between
      refreshes.
  """

  def init_fn(params):
    del params
    return MaskedDecayState()

  def update_fn(updates, state, params=None, *, decay=decay, masks=None, **extra):
    del extra
    if params is None:
      raise ValueError("add_masked_decay needs the params")
    lam = decay if not callable(decay) else decay(state)
    if masks is None:
      masks = jax.tree.map(lambda w, sparse: mask_fn(w) if sparse else None, params, is_sparse)

    def one(u, w, sparse, m):
      if not sparse:
        return u
      pruned = jnp.where(m, 0, w)
      return u + (lam * pruned).astype(u.dtype)

    return jax.tree.map(one, updates, params, is_sparse, masks,
                        is_leaf=lambda x: x is None), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def is_matrix(params) -> Any:
  """Weight decay only on matrices (kernels, embeddings), not on biases and norms."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config, is_sparse: Any,
                   mask_fn: Callable[[jax.Array], jax.Array]) -> optax.GradientTransformation:
  """AdamW with warm-up + cosine lr, clipping, and the configured masked-decay placement."""
  o, s = config.optim, config.sparsity
  lr = schedules.learning_rate(o, config.total_steps)
  # Masked decay for the methods that take it, with a fixed lambda_W or one chosen during
  # warm-up (decay_control; train_step then passes it as the `decay` extra argument).
  use_decay = (projections.get_projection(s.projection).masked_decay
               and (s.decay > 0 or s.decay_auto))
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
