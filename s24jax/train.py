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
from flax import traverse_util
import jax.numpy as jnp
import optax

from s24jax import decay_control
from s24jax import masks as masks_lib
from s24jax import projections
from s24jax import state as state_lib
from s24jax.model import GPT2
from s24jax.state import TrainState

Batch = dict[str, jax.Array]

# fold_in constant separating the MVUE stream from other uses of the step rng ('mvue').
_MVUE_STREAM = 0x6D767565


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
  if proj.mask_in_state:   # MST: the mask changes only in s24jax.mst's topology updates
    return {}
  return {p: proj.mask(state_lib.get_path(params, p)["kernel"])
          for p in state_lib.sparse_layer_paths(sparsity)}


def refreshed_masks(model: GPT2, params: Any, sparsity: Any, refresh: jax.Array
                    ) -> tuple[dict[tuple[str, ...], jax.Array], jax.Array]:
  """Cached masks (Projection.mask_refresh, e.g. t_sr_ste): recomputed only when `refresh`.

  Returns the masks the next forward passes use (fresh mask(W) if `refresh`, else the cached
  state['mask']) and the kept-magnitude ratio of the fresh masks over plain 2:4 masks,
  sum |W| m / sum |W| nm_mask(W) over all sparse layers (`transposable_kept_ratio`; NaN
  when not refreshing). Under jit only the taken branch runs: no mask work between refreshes.
  """
  paths = state_lib.sparse_layer_paths(sparsity)
  kernels = {p: state_lib.get_path(params, p)["kernel"] for p in paths}
  cached = {p: state_lib.get_path(sparsity, p)["mask"] for p in paths}

  def fresh():
    new = current_masks(model, params, sparsity)
    kept = sum(jnp.sum(jnp.where(new[p], jnp.abs(w), 0.0)) for p, w in kernels.items())
    kept_nm = sum(jnp.sum(jnp.where(masks_lib.nm_mask(w), jnp.abs(w), 0.0))
                  for w in kernels.values())
    return new, (kept / jnp.maximum(kept_nm, 1e-30)).astype(jnp.float32)

  return jax.lax.cond(refresh, fresh, lambda: (cached, jnp.float32(jnp.nan)))


def _masks_like_params(params: Any, sparsity: Any) -> Any:
  """A params-shaped tree with each sparse kernel's current forward mask, None elsewhere."""
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params))
  sparse = {p + ("kernel",): state_lib.get_path(sparsity, p)["mask"]
            for p in state_lib.sparse_layer_paths(sparsity)}
  return traverse_util.unflatten_dict({k: sparse.get(k) for k in flat})


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
  cfg = model.config.sparsity
  proj = projections.get_projection(cfg.projection)
  # MVUE (sparse_ops): each SparseLinear draws its key with make_rng('mvue').
  rngs = {"mvue": jax.random.fold_in(rng, _MVUE_STREAM)}

  def loss_fn(params):
    logits = model.apply(_variables(params, state.sparsity), batch["inputs"],
                         rngs=rngs)                                              # (B, T, V)
    loss_sum = cross_entropy_sum(logits, batch["targets"])
    return loss_sum / batch["targets"].size, loss_sum

  (_, loss_sum), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  mask_in_state = projections.get_projection(model.config.sparsity.projection).mask_in_state
  if mask_in_state:   # MST: only active weights learn (the dense gradient is for regrowth)
    grads = state_lib.mask_sparse_kernels(grads, state.sparsity)
  # Masked decay (optim.add_masked_decay) on the mask this forward used, with lambda_W from
  # the warm-up controller if on; none in the dense fine-tuning phase.
  decay = 0.0 if proj.is_dense else decay_control.current_decay(state.sparsity, cfg)
  extra = {"decay": jnp.asarray(decay, jnp.float32)}
  if state.sparsity and not proj.is_dense:
    extra["masks"] = _masks_like_params(state.params, state.sparsity)
  updates, opt_state = optax.with_extra_args_support(tx).update(
      grads, state.opt_state, state.params, **extra)
  params = optax.apply_updates(state.params, updates)
  if mask_in_state:   # pruned weights stay exactly 0 whatever the optimizer does
    params = state_lib.mask_sparse_kernels(params, state.sparsity)

  extra_metrics = {}
  if proj.mask_refresh and not proj.is_dense:
    # Cached mask: recomputed every k optimizer steps (after the k-th, 2k-th, ... update).
    # Its flip rate is reported at refreshes as changed / k, the mean per-step rate over
    # the interval, and NaN in between (no measurement; the loop averages what it has).
    k = cfg.mask_refresh_every
    refresh = (state.step + 1) % k == 0
    masks, kept_ratio = refreshed_masks(model, params, state.sparsity, refresh)
    flips = {name: jnp.where(refresh, v / k, jnp.nan)
             for name, v in flip_rates(masks, state.sparsity).items()}
    extra_metrics["transposable_kept_ratio"] = kept_ratio
  else:
    masks = current_masks(model, params, state.sparsity)
    flips = flip_rates(masks, state.sparsity)
  sparsity = update_projection_states(model, params, state.sparsity, state.step + 1)
  if not proj.is_dense and decay_control.enabled(cfg) and decay_control.KEY in sparsity:
    sparsity = {**sparsity, decay_control.KEY: decay_control.update(
        sparsity[decay_control.KEY], flips.get("flip_rate", jnp.nan), state.step, cfg)}
  if proj.masked_decay and not proj.is_dense and (cfg.decay > 0 or cfg.decay_auto):
    extra_metrics["sparsity/decay"] = extra["decay"]   # lambda_W used by this step
  metrics = {"loss": loss_sum, "count": jnp.asarray(batch["targets"].size, jnp.float32),
             "grad_norm": optax.tree.norm(grads), **flips,
             **state_scalars(sparsity), **extra_metrics}
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
  if decay_control.enabled(model.config.sparsity):   # lambda_W chosen during warm-up
    sparsity = {**sparsity, decay_control.KEY: decay_control.init_state(model.config.sparsity)}
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
