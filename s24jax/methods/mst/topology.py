"""MST's topology update on device (pure jnp; counts may be traced): drop and grow one layer,
the optimizer state of a skipped step, Adam's moments reset (docs/algorithms.md, MST,
"Update"). The projection is the shared straight-through rule (methods/straight_through.py)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from s24jax.state import TrainState

_RNG_TAG = 0x6D7374   # 'mst': decorrelates the growth rng from other uses of the step rng


def ranks(key: jax.Array) -> jax.Array:
  """Rank of every entry of a 1-D key in ascending order; ties: the lower index first."""
  order = jnp.argsort(key, stable=True)
  return jnp.zeros(key.shape, jnp.int32).at[order].set(jnp.arange(key.size, dtype=jnp.int32))


def random_keys(key: jax.Array, size: int) -> jax.Array:
  """One uint32 per entry; random growth picks the candidates with the smallest (ties: lower
  index), i.e. a uniformly random subset (tests/mst_reference.perm_from_keys)."""
  return jax.random.bits(key, (size,), jnp.uint32)


def update_layer_mask(w: jax.Array, mask: jax.Array, grad: jax.Array, n_prune, n_grad, n_rand,
                      u: jax.Array, *, regrow_dropped: bool = True
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Drop-and-grow of one layer. Returns the new mask and bool masks of what happened.

  w, mask, grad: (out, in); grad is dL/dW~, dense; u: (out * in,) random keys
  (`random_keys`). Drops the n_prune smallest |w| among the active entries; grows the n_grad
  largest |grad| among the candidates (every entry not kept, or with regrow_dropped=False only
  those inactive before), then the n_rand remaining candidates with the smallest u. Ties: the
  lower flat index first. Info: 'dropped', 'grown_gradient', 'grown_random',
  'regrown_dropped' (dropped and grown back).
  """
  shape = mask.shape
  m = mask.reshape(-1)                                                       # (D,)
  a = jnp.abs(w.reshape(-1).astype(jnp.float32))                             # (D,)
  dropped = m & (ranks(jnp.where(m, a, jnp.inf)) < n_prune)
  kept = m & ~dropped
  candidates = ~kept if regrow_dropped else ~m
  g = jnp.abs(grad.reshape(-1).astype(jnp.float32))                          # (D,)
  grown_gradient = candidates & (ranks(jnp.where(candidates, -g, jnp.inf)) < n_grad)
  rest = candidates & ~grown_gradient
  grown_random = rest & (ranks(jnp.where(rest, u, jnp.uint32(0xFFFFFFFF))) < n_rand)
  new = kept | grown_gradient | grown_random
  info = {"dropped": dropped, "grown_gradient": grown_gradient, "grown_random": grown_random,
          "regrown_dropped": dropped & new}
  return new.reshape(shape), {k: v.reshape(shape) for k, v in info.items()}


def reset_params_shaped(tree: Any, params: Any, reset: Any) -> Any:
  """Zeros the entries where `reset` is True in every params-shaped subtree of `tree`.

  `tree` is an optimizer state (any optax chain): the subtrees with the structure of the
  params (Adam's mu and nu, ...) are the per-weight moments; the rest (counts) is kept.
  `reset` is params-shaped (bool arrays, or scalar False where nothing is reset).
  """
  treedef = jax.tree.structure(params)
  def is_params(x):
    return jax.tree.structure(x) == treedef

  def one(sub):
    if not is_params(sub):
      return sub
    return jax.tree.map(lambda v, r: jnp.where(r, jnp.zeros_like(v), v), sub, reset)

  return jax.tree.map(one, tree, is_leaf=is_params)


def skipped_opt_state(old: Any, new: Any) -> Any:
  """The optimizer state of a skipped step: `old`, except that learning-rate schedule counts
  advance (the reference's lr follows the iteration, its Adam does not step)."""
  def is_schedule(x):
    return isinstance(x, optax.ScaleByScheduleState)

  return jax.tree.map(lambda o, n: n if is_schedule(o) else o, old, new, is_leaf=is_schedule)


def update_rng(state: TrainState) -> jax.Array:
  return jax.random.fold_in(jax.random.fold_in(state.rng, state.step), _RNG_TAG)


def select(pred, a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)
