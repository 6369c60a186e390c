"""Pure training and evaluation steps, and the loop that drives them.

`train_step(state, batch)` and `eval_step(...)` are module-level, jitted functions (the model
and optimizer are static arguments); the state is donated. The rng of step t is
fold_in(state.rng, t) and the batch of step t is a pure function of (seed, t), so a run that
is killed and resumed reproduces an uninterrupted one step for step.
"""
from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from s24jax import projections
from s24jax import state as state_lib
from s24jax.model import GPT2
from s24jax.state import TrainState

Batch = dict[str, jax.Array]


def cross_entropy_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Sum over tokens of -log p(target); logits (B, T, V) float32, targets (B, T)."""
  logz = jax.nn.logsumexp(logits, axis=-1)                                   # (B, T)
  tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]     # (B, T)
  return jnp.sum(logz - tgt)


def _variables(params, sparsity):
  return {"params": params, "sparsity": sparsity} if sparsity else {"params": params}


def current_masks(model: GPT2, params: Any, sparsity: Any) -> dict[tuple[str, ...], jax.Array]:
  """The projection's mask of every sparse kernel (what the forward pass keeps)."""
  proj = projections.get_projection(model.config.sparsity.projection)
  if proj.is_dense:   # dense fine-tuning: no mask to monitor
    return {}
  return {p: proj.mask(state_lib.get_path(params, p)["kernel"])
          for p in state_lib.sparse_layer_paths(sparsity)}


def flip_rates(new: dict, old: Any) -> dict[str, jax.Array]:
  """Per-layer and global flip rate (DESIGN.md: fraction of mask entries that changed)."""
  out, changed, total = {}, 0.0, 0
  for path, m in new.items():
    m_old = state_lib.get_path(old, path)["mask"]
    diff = jnp.sum(m != m_old)
    out[f"flip_rate/{state_lib.layer_name(path)}"] = diff / m.size
    changed, total = changed + diff, total + m.size
  if total:
    out["flip_rate"] = changed / total
  return out


def update_projection_states(model: GPT2, params: Any, sparsity: Any, step: jax.Array) -> Any:
  """Applies the projection's `update_state` hook (if any) to every sparse layer's state.

  `step` is the new optimizer step count; e.g. S-STE recomputes its scale every
  `sparsity.rescale_every` steps here. Masks are left alone (they are updated separately).
  """
  cfg = model.config.sparsity
  proj = projections.get_projection(cfg.projection)
  if proj.update_state is None or not sparsity:
    return sparsity
  sparsity = flax.core.unfreeze(jax.tree.map(lambda x: x, sparsity))
  for path in state_lib.sparse_layer_paths(sparsity):
    layer = state_lib.get_path(sparsity, path)
    kernel = state_lib.get_path(params, path)["kernel"]
    layer.update(proj.update_state(kernel, layer, step, cfg))
  return sparsity


def state_scalars(sparsity: Any) -> dict[str, jax.Array]:
  """Scalar projection state (e.g. the S-STE scale) per layer and its mean over layers.

  Logged as 'sparsity/<name>/<layer>' and 'sparsity/<name>' so a growing recomputed
  scale is visible in the metrics.
  """
  out, per_name = {}, {}
  for path in state_lib.sparse_layer_paths(sparsity):
    for name, value in state_lib.get_path(sparsity, path).items():
      if name != "mask" and getattr(value, "ndim", None) == 0:
        out[f"sparsity/{name}/{state_lib.layer_name(path)}"] = value
        per_name.setdefault(name, []).append(value.astype(jnp.float32))
  for name, values in per_name.items():
    out[f"sparsity/{name}"] = jnp.mean(jnp.stack(values))
  return out


@functools.partial(jax.jit, static_argnames=("model", "tx"), donate_argnames=("state",))
def train_step(state: TrainState, batch: Batch, *, model: GPT2,
               tx: optax.GradientTransformation) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step. Returns the new state and metrics as sums plus a count."""
  rng = jax.random.fold_in(state.rng, state.step)
  del rng  # no dropout or stochastic estimator in the base recipe; seam for MVUE.

  def loss_fn(params):
    logits = model.apply(_variables(params, state.sparsity), batch["inputs"])   # (B, T, V)
    loss_sum = cross_entropy_sum(logits, batch["targets"])
    return loss_sum / batch["targets"].size, loss_sum

  (_, loss_sum), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)

  masks = current_masks(model, params, state.sparsity)
  sparsity = update_projection_states(model, params, state.sparsity, state.step + 1)
  metrics = {"loss": loss_sum, "count": jnp.asarray(batch["targets"].size, jnp.float32),
             "grad_norm": optax.global_norm(grads), **flip_rates(masks, state.sparsity),
             **state_scalars(sparsity)}
  sparsity = state_lib.with_masks(sparsity, masks) if masks else sparsity
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                            sparsity=sparsity)
  return new_state, metrics


@functools.partial(jax.jit, static_argnames=("model",))
def eval_step(params: Any, sparsity: Any, batch: Batch, *, model: GPT2) -> dict[str, jax.Array]:
  logits = model.apply(_variables(params, sparsity), batch["inputs"])
  return {"loss": cross_entropy_sum(logits, batch["targets"]),
          "count": jnp.asarray(batch["targets"].size, jnp.float32)}


def init_state(model: GPT2, tx_fn, seed: int) -> TrainState:
  """Fresh state: params, the sparsity collection (scales, initial masks), optimizer state.

  `tx_fn(params, sparsity)` builds the optimizer (it needs to know which kernels are sparse).
  """
  init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
  tokens = jnp.zeros((1, model.config.seq_len), jnp.int32)
  variables = flax.core.unfreeze(model.init(init_rng, tokens))
  params = variables["params"]
  sparsity = variables.get("sparsity", {})
  tx = tx_fn(params, sparsity)
  return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params),
                    sparsity=sparsity, rng=train_rng)


def project_params(model: GPT2, params: Any, sparsity: Any) -> Any:
  """Replaces each sparse latent W by the weight the forward pass used, S(W).

  Used when switching to dense fine-tuning, so the dense phase starts from the sparse
  network (continuous loss) rather than from the unpruned latent weights.
  """
  cfg = model.config.sparsity
  proj = projections.get_projection(cfg.projection)
  params = flax.core.unfreeze(jax.tree.map(lambda x: x, params))
  for path in state_lib.sparse_layer_paths(sparsity):
    layer = state_lib.get_path(params, path)
    layer["kernel"] = proj.apply(layer["kernel"], state_lib.get_path(sparsity, path), cfg)
  return params
