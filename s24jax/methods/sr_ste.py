"""sr_ste: hard-threshold 2:4, straight-through, with SR-STE's masked decay (Zhou et al. 2021;
with Adam as in Hu et al. 2024), and lambda_W chosen automatically during warm-up.

docs/algorithms.md, "SR-STE" and "Choosing lambda_W in warm-up", describe the rules; here:
- `sr_ste24`: the projection, with the decay inside the backward ('backward' placement);
- `masked_decay`: the optax transform for the two Adam placements, 'gradients' (after
  clipping, before Adam: Hu et al. 2024) and 'weights' (decoupled, after Adam);
- the lambda_W controller (`decay_auto`): its state (`ControllerState`) is the method state
  of the train state, updated from the step's global flip rate inside the jitted step
  (`update`), frozen after warm-up;
- `SRSTE`, the method; `t_sr_ste` (Hu et al. 2024) extends it with a cached transposable mask.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax
import flax.struct
import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import traverse_util

from s24jax import hooks
from s24jax.kernels import masks
from s24jax import state as state_lib
from s24jax.methods import base

PLACEMENTS = ("gradients", "weights", "backward")
# Hu et al. 2024's lambda_W per GPT-2 size (the experiment files pick it by variant).
PAPER_DECAY = {"124m": 6e-5, "350m": 2e-4, "774m": 6e-5, "1558m": 2e-4}
# The controller: EMA of the flip rate (per measurement); lambda stays in [MIN, MAX].
CONTROL_EMA = 0.8
MIN_DECAY, MAX_DECAY = 1e-8, 1.0


@jax.custom_vjp
def sr_ste24(w: jax.Array, decay: jax.Array) -> jax.Array:
  """Forward W~ = m(W) * W. Backward: dL/dW := dL/dW~ + decay * (1 - m(W)) * W.

  The SGD form of SR-STE; `decay` is 0 unless the placement is 'backward' (with Adam the
  decay goes into the optimizer, `masked_decay`). `decay` is a hyper-parameter: no cotangent.
  """
  return jnp.where(masks.nm_mask(w), w, 0)


def _sr_ste24_fwd(w, decay):
  m = masks.nm_mask(w)
  return jnp.where(m, w, 0), (w, m, decay)


def _sr_ste24_bwd(res, g):
  w, m, decay = res
  dw = g + (decay * jnp.where(m, 0, w)).astype(g.dtype)
  return dw, jnp.zeros_like(decay)


sr_ste24.defvjp(_sr_ste24_fwd, _sr_ste24_bwd)


@flax.struct.dataclass
class ControllerState:
  """The lambda_W warm-up controller's state (TrainState.method_state)."""
  decay: jax.Array      # float32: lambda_W now
  flip_ema: jax.Array   # float32: smoothed global flip rate
  count: jax.Array      # int32: steps the controller acted


def masked_decay(owner: "SRSTE", is_sparse: Any) -> optax.GradientTransformationExtraArgs:
  """updates += lambda_W * (1 - m) * W on the leaves where `is_sparse` is True, m the mask
  the forward pass used (stored in the sparsity collection), lambda_W `owner`'s (fixed, or
  the controller's in the method state). Both come from the step's extra arguments; a step
  whose model is not sparse (dense fine-tuning) leaves the updates alone."""

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, method=None, sparsity=None, method_state=None,
                **extra):
    del extra
    if method is None or not method.sparse:
      return updates, state
    if params is None or sparsity is None:
      raise ValueError("masked_decay needs the params and the sparsity collection")
    decay = owner.current_decay(method_state)
    forward = forward_masks(params, sparsity)

    def one(u, w, sparse, m):
      if not sparse:
        return u
      return u + (decay * jnp.where(m, 0, w)).astype(u.dtype)

    return jax.tree.map(one, updates, params, is_sparse, forward,
                        is_leaf=lambda x: x is None), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def forward_masks(params: Any, sparsity: Any) -> Any:
  """A params-shaped tree with each sparse weight's stored forward mask (a kernel, or the
  tied embedding 'wte'), None elsewhere."""
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params))
  sparse = {key: state_lib.get_path(sparsity, key[:-1])["mask"]
            for key in state_lib.sparse_weight_keys(params, sparsity)}
  return traverse_util.unflatten_dict({k: sparse.get(k) for k in flat})


@dataclasses.dataclass(frozen=True)
class SRSTE(base.Method, base.OptimizerTransforms):
  """Masked decay lambda_W (1 - m) W, at `decay_placement`; lambda_W fixed (`decay` > 0) or
  chosen in warm-up (`decay_auto`, with decay = 0)."""
  decay: float = 0.0                   # lambda_W; 0 with decay_auto: chosen in warm-up
  decay_placement: str = "gradients"   # 'gradients' (Hu et al.), 'weights', 'backward'
  # The warm-up controller (docs/algorithms.md): lambda starts at decay_auto_init and is
  # multiplied (divided) by decay_auto_rate whenever the smoothed global flip rate leaves
  # [target / band, target * band], during steps [N/2, N) with N = decay_auto_steps
  # (0: optim.warmup_steps); then frozen.
  decay_auto: bool = False
  decay_auto_init: float = 6e-5
  decay_auto_target: float = 3e-3
  decay_auto_band: float = 2.0
  decay_auto_rate: float = 1.1
  decay_auto_steps: int = 0

  def __post_init__(self):
    if self.decay_placement not in PLACEMENTS:
      raise ValueError(f"unknown sparsity.{self.name or 'sr_ste'}.decay_placement "
                       f"{self.decay_placement!r}; valid: {', '.join(PLACEMENTS)}")
    if self.decay < 0:
      raise ValueError(f"sparsity.{self.name}.decay (lambda_W) must be >= 0, got {self.decay}")
    if self.decay_auto:
      if self.decay_placement == "backward":
        raise ValueError("decay_auto chooses lambda_W in the optimizer; use decay_placement "
                         "'gradients' or 'weights', not 'backward'")
      if not (self.decay_auto_init > 0 and self.decay_auto_target > 0
              and self.decay_auto_band > 1 and self.decay_auto_rate > 1
              and self.decay_auto_steps >= 0):
        raise ValueError("decay_auto needs decay_auto_init > 0, decay_auto_target > 0, "
                         "decay_auto_band > 1, decay_auto_rate > 1, decay_auto_steps >= 0; got "
                         f"{self.decay_auto_init}, {self.decay_auto_target}, "
                         f"{self.decay_auto_band}, {self.decay_auto_rate}, "
                         f"{self.decay_auto_steps}")

  def configure(self, run):
    if self.controlled and not self.decay_auto_steps:   # lambda_W is chosen in warm-up
      return dataclasses.replace(self, decay_auto_steps=run.warmup_steps)
    return self

  @property
  def uses_decay(self) -> bool:
    return self.decay > 0 or self.decay_auto

  @property
  def controlled(self) -> bool:
    """lambda_W comes from the warm-up controller (a fixed decay > 0 always wins)."""
    return self.decay_auto and self.decay == 0

  # -- forward ----------------------------------------------------------------------------------

  def backward_decay(self) -> jax.Array:
    return jnp.asarray(self.decay if self.decay_placement == "backward" else 0.0, jnp.float32)

  def project(self, kernel, layer):
    del layer
    return sr_ste24(kernel, self.backward_decay())

  # -- optimizer --------------------------------------------------------------------------------

  def init_state(self, params, sparsity, rng):
    del rng
    if not self.controlled:
      return params, sparsity, {}
    return params, sparsity, ControllerState(
        decay=jnp.asarray(self.decay_auto_init, jnp.float32),
        flip_ema=jnp.asarray(0.0, jnp.float32), count=jnp.asarray(0, jnp.int32))

  def current_decay(self, method_state: Any) -> jax.Array:
    if self.controlled:
      return method_state.decay
    return jnp.asarray(self.decay, jnp.float32)

  def optimizer_transforms(self, placement, is_sparse):
    if self.uses_decay and placement == self.decay_placement:
      return [masked_decay(self, is_sparse)]
    return []

  def update(self, before, after, grads):
    decay = self.current_decay(before.method_state) if self.uses_decay else None
    after, metrics = super().update(before, after, grads)
    if self.controlled:
      after = after.replace(method_state=self.control(
          before.method_state, metrics.get("flip_rate", jnp.nan), before.step))
    if decay is not None:
      metrics["sparsity/decay"] = decay   # lambda_W used by this step
    return after, metrics

  def control(self, ctrl: ControllerState, flip_rate: jax.Array, step: jax.Array
              ) -> ControllerState:
    """One controller step after optimizer step `step` (0-based) measured `flip_rate` (the
    global per-step rate; NaN: no measurement). Acts only while N/2 <= step < N."""
    r = jnp.asarray(flip_rate, jnp.float32)
    n = self.decay_auto_steps
    active = (step >= n // 2) & (step < n) & ~jnp.isnan(r)
    ema = jnp.where(ctrl.count == 0, r, CONTROL_EMA * ctrl.flip_ema + (1 - CONTROL_EMA) * r)
    lam = ctrl.decay
    hi = self.decay_auto_target * self.decay_auto_band
    lo = self.decay_auto_target / self.decay_auto_band
    new_lam = jnp.where(ema > hi, jnp.minimum(lam * self.decay_auto_rate, MAX_DECAY),
                        jnp.where(ema < lo, jnp.maximum(lam / self.decay_auto_rate, MIN_DECAY),
                                  lam))
    return ControllerState(decay=jnp.where(active, new_lam, lam).astype(jnp.float32),
                           flip_ema=jnp.where(active, ema, ctrl.flip_ema).astype(jnp.float32),
                           count=ctrl.count + active.astype(jnp.int32))

  # -- the loop ---------------------------------------------------------------------------------

  def chores(self, run):
    chores = super().chores(run)
    if self.controlled:
      chores.append(hooks.Hook(self._log_chosen_decay, name="lambda_W frozen",
                               due=lambda step: step == self.decay_auto_steps))
    return chores

  def never_in_band(self, ctrl: ControllerState) -> bool:
    """True if the controller raised lambda_W at every step it acted (or hit MAX_DECAY): the
    smoothed flip rate never came down to the band. Any step that held or lowered lambda_W
    takes at least one factor of `rate` off log(lambda / init) / log(rate) = count."""
    count, chosen = int(ctrl.count), float(ctrl.decay)
    if count == 0:
      return False
    raised = math.log(chosen / self.decay_auto_init) / math.log(self.decay_auto_rate)
    return chosen >= MAX_DECAY * (1 - 1e-6) or raised > count - 0.5

  def _log_chosen_decay(self, ctx: hooks.Context) -> None:
    ctrl = ctx.state.method_state
    chosen = float(ctrl.decay)
    logging.info("step %d: end of the lambda_W warm-up controller; lambda_W frozen at %.4g",
                 ctx.step, chosen)
    stuck = self.never_in_band(ctrl)
    if stuck:
      # Seen on the tiny Hu et al. recipe (README, "Hu et al. 2024"): with the decay fed into
      # Adam, a larger lambda_W stops lowering the flip rate, and the controller runs away.
      logging.warning(
          "lambda_W rose at every one of the controller's %d steps (%.3g -> %.3g): the "
          "smoothed flip rate never came down to %.3g x %.3g. Past some value lambda_W no "
          "longer lowers it (Adam normalises the decayed gradient), so this lambda_W is likely "
          "far larger than needed; consider a fixed sparsity.%s.decay (the paper's: %s) or a "
          "decay_auto_target nearer this run's flip rate.", int(ctrl.count),
          self.decay_auto_init, chosen, self.decay_auto_target, self.decay_auto_band,
          self.name, ", ".join(f"{k}: {v:g}" for k, v in PAPER_DECAY.items()))
    ctx.write(ctx.step, {"sparsity/decay_chosen": chosen,
                         "sparsity/decay_band_reached": float(not stuck)})
