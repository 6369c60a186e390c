"""sr_ste: hard-threshold 2:4, straight-through, with SR-STE's masked decay (Zhou et al. 2021;
with Adam as in Hu et al. 2024): lambda_W fixed (Hu et al.'s 124M value unless set), or
adjusted during warm-up from there (`decay_auto`).

docs/algorithms.md, "SR-STE" and "Choosing lambda_W in warm-up", describe the rules; here:
- the projection: the shared straight-through rule (methods/straight_through.py) on the hard
  2:4 mask, with the decay inside the backward in the 'backward' placement;
- `masked_decay`: the optax transform for the two Adam placements, 'gradients' (after
  clipping, before Adam: Hu et al. 2024) and 'weights' (decoupled, after Adam);
- the lambda_W controller (`decay_auto`): its state (`ControllerState`) is the method state
  of the train state, updated from the step's global flip rate (`steer_on`) inside the jitted
  step (`update`, `control`): in rounds, lambda_W raised only while raising it lowers the
  flip rate, frozen after warm-up;
- `SRSTE`, the method; `t_sr_ste` (Hu et al. 2024) extends it with a cached transposable mask.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax
import flax.struct
import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import traverse_util

from s24jax import chores as chores_lib
from s24jax.kernels import masks
from s24jax import state as state_lib
from s24jax.methods import base
from s24jax.methods import straight_through

PLACEMENTS = ("gradients", "weights", "backward")
# Hu et al. 2024's lambda_W per GPT-2 size (the experiment files pick it by variant; the 124M
# value is SRSTE's default).
PAPER_DECAY = {"124m": 6e-5, "350m": 2e-4, "774m": 6e-5, "1558m": 2e-4}
# The controller keeps lambda_W in [MIN_DECAY, min(MAX_GROWTH x its start, MAX_DECAY)]. The
# growth cap is a safety net: every raise must lower the flip rate or is undone, so only a
# rate that keeps responding without reaching the band (or noise posing as a response) gets
# there.
MIN_DECAY, MAX_DECAY = 1e-8, 1.0
MAX_GROWTH = 100.0


@flax.struct.dataclass
class ControllerState:
  """The lambda_W warm-up controller's state (TrainState.method_state)."""
  decay: jax.Array              # float32: lambda_W now
  before_raise: jax.Array       # float32: lambda_W before the latest raise (the way back)
  rate_before_raise: jax.Array  # float32: the round mean flip rate measured at before_raise
  last_rate: jax.Array          # float32: the latest round's mean flip rate (NaN: none yet)
  raised: jax.Array             # bool: the latest round ended in a raise (checked next round)
  stopped: jax.Array            # bool: a raise did not lower the rate; lambda_W held for good
  round_sum: jax.Array          # float32: sum of the current round's measured flip rates
  round_count: jax.Array        # int32: their number
  rounds: jax.Array             # int32: rounds the controller acted on


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
  """Masked decay lambda_W (1 - m) W, at `decay_placement`; lambda_W fixed (`decay`), or
  starting from `decay` and adjusted in warm-up (`decay_auto`). decay = 0: plain STE."""
  # The metric the controller steers on: the per-step flip rate of the mask the forward
  # applies (t_sr_ste: of its transposable mask).
  steer_on: ClassVar[str] = "flip_rate"
  # Hu et al. 2024's value for GPT-2 124M, so that the method chosen by name (without an
  # experiment file) is SR-STE, not plain STE; the experiment files pick PAPER_DECAY by size.
  decay: float = PAPER_DECAY["124m"]
  decay_placement: str = "gradients"   # 'gradients' (Hu et al.), 'weights', 'backward'
  # The warm-up controller (docs/algorithms.md, "Choosing lambda_W in warm-up"): from `decay`,
  # in rounds of decay_auto_every steps during steps [N/2, N) (N = decay_auto_steps, 0:
  # optim.warmup_steps), lambda_W is multiplied by decay_auto_rate while the round's flip rate
  # is above [target / band, target * band] and the last raise cut it by at least
  # decay_auto_min_response (else that raise is undone and the controller stops), divided by
  # it below the band; frozen from step N on.
  decay_auto: bool = False
  decay_auto_target: float = 3e-3
  decay_auto_band: float = 2.0
  decay_auto_rate: float = 2.0
  decay_auto_every: int = 10
  decay_auto_min_response: float = 0.1
  decay_auto_steps: int = 0

  def __post_init__(self):
    if self.decay_placement not in PLACEMENTS:
      raise ValueError(f"unknown sparsity.{self.name or 'sr_ste'}.decay_placement "
                       f"{self.decay_placement!r}; valid: {', '.join(PLACEMENTS)}")
    if self.decay < 0:
      raise ValueError(f"sparsity.{self.name}.decay (lambda_W) must be >= 0, got {self.decay}")
    if self.decay_auto:
      self._check_controller()

  def _check_controller(self):
    name = f"sparsity.{self.name or 'sr_ste'}"
    if self.decay_placement == "backward":
      raise ValueError("decay_auto chooses lambda_W in the optimizer; use decay_placement "
                       "'gradients' or 'weights', not 'backward'")
    if self.decay <= 0:
      # The controller multiplies lambda_W: from 0 it could never move.
      raise ValueError(f"{name}.decay_auto starts lambda_W from {name}.decay, which must be "
                       f"> 0 (the default is Hu et al.'s {PAPER_DECAY['124m']:g}); decay=0 "
                       "without decay_auto is plain STE")
    base.check_positive_int(f"{name}.decay_auto_every", self.decay_auto_every)
    if not (self.decay_auto_target > 0 and self.decay_auto_band > 1
            and self.decay_auto_rate > 1 and 0 <= self.decay_auto_min_response < 1
            and self.decay_auto_steps >= 0):
      raise ValueError("decay_auto needs decay_auto_target > 0, decay_auto_band > 1, "
                       "decay_auto_rate > 1, 0 <= decay_auto_min_response < 1, "
                       f"decay_auto_steps >= 0; got {self.decay_auto_target}, "
                       f"{self.decay_auto_band}, {self.decay_auto_rate}, "
                       f"{self.decay_auto_min_response}, {self.decay_auto_steps}")

  def configure(self, facts):
    if not self.controlled:
      return self
    method = self
    if not self.decay_auto_steps:   # lambda_W is chosen in warm-up
      method = dataclasses.replace(self, decay_auto_steps=facts.warmup_steps)
    start, end = method.controller_window
    k = method.decay_auto_every
    if (end - start) // k < 2:
      logging.warning("sparsity.%s.decay_auto: the window [%d, %d) holds fewer than two rounds "
                      "of decay_auto_every=%d steps; the effect of a raise of lambda_W is "
                      "never checked", self.name, start, end, k)
    return method

  @property
  def uses_decay(self) -> bool:
    return self.decay > 0

  @property
  def controlled(self) -> bool:
    """lambda_W comes from the warm-up controller (starting from `decay`)."""
    return self.decay_auto

  @property
  def controller_window(self) -> tuple[int, int]:
    """[start, end): the steps (0-based indices) whose flip rates the controller reads,
    the second half of decay_auto_steps = N: [N/2, N). lambda_W is frozen from step N on."""
    n = self.decay_auto_steps
    return n // 2, n

  def in_controller_window(self, step: Any) -> Any:
    """Whether step `step` (an index; int or traced) is in `controller_window`."""
    start, end = self.controller_window
    return (step >= start) & (step < end)

  @property
  def max_decay(self) -> float:
    return min(self.decay * MAX_GROWTH, MAX_DECAY)

  # -- forward ----------------------------------------------------------------------------------

  def backward_decay(self) -> float:
    """lambda_W in the projection's backward ('backward' placement); 0 otherwise."""
    return float(self.decay) if self.decay_placement == "backward" else 0.0

  def project(self, kernel, layer):
    del layer
    return straight_through.masked(kernel, masks.nm_mask(kernel), self.backward_decay())

  # -- optimizer --------------------------------------------------------------------------------

  def init_state(self, params, sparsity, rng):
    del rng
    if not self.controlled:
      return params, sparsity, {}
    # One fresh buffer per leaf: the train step donates the state, and a buffer shared by
    # two leaves would be donated twice.
    f32, i32 = lambda x: jnp.array(x, jnp.float32), lambda x: jnp.array(x, jnp.int32)
    return params, sparsity, ControllerState(
        decay=f32(self.decay), before_raise=f32(self.decay), rate_before_raise=f32(jnp.nan),
        last_rate=f32(jnp.nan), raised=jnp.array(False), stopped=jnp.array(False),
        round_sum=f32(0.0), round_count=i32(0), rounds=i32(0))

  def current_decay(self, method_state: Any) -> jax.Array:
    if self.controlled:
      return method_state.decay
    return jnp.asarray(self.decay, jnp.float32)

  def optimizer_transforms(self, placement, is_sparse):
    if self.uses_decay and placement == self.decay_placement:
      return [masked_decay(self, is_sparse)]
    return []

  def update(self, before, after, grads, info):
    decay = self.current_decay(before.method_state) if self.uses_decay else None
    after, metrics = super().update(before, after, grads, info)
    metrics.update(self.extra_flip_rates(before, after, info))
    if self.controlled:
      after = after.replace(method_state=self.control(
          before.method_state, metrics.get(self.steer_on, jnp.nan), info.step))
    if decay is not None:
      metrics[f"{base.STATE_METRICS}decay"] = decay   # lambda_W used by this step
    return after, metrics

  def extra_flip_rates(self, before, after, info) -> base.Metrics:
    """Flip rates besides the refresh's (t_sr_ste: of its transposable mask). None here: the
    forward mask is the plain 2:4 mask, whose rate `refresh` measures."""
    del before, after, info
    return {}

  def control(self, ctrl: ControllerState, flip_rate: jax.Array, step: jax.Array
              ) -> ControllerState:
    """One controller step after optimizer step `step` (0-based) measured `flip_rate` (NaN:
    no measurement). Rounds of K = decay_auto_every steps tile [N/2, N) from N/2; a round's
    mean is over its last K - K // 2 steps (the first half lets the mask and Adam's moments
    follow the previous round's change); at a round's last step `decide` acts on it. A round
    the end of the window cuts short, or one without measurements, is not acted on."""
    r = jnp.asarray(flip_rate, jnp.float32)
    k = self.decay_auto_every
    in_window = self.in_controller_window(step)
    phase = jnp.mod(step - self.controller_window[0], k)
    measured = in_window & (phase >= k // 2) & ~jnp.isnan(r)
    total = ctrl.round_sum + jnp.where(measured, r, 0.0)
    count = ctrl.round_count + measured.astype(jnp.int32)
    over = in_window & (phase == k - 1)
    act = over & (count > 0) & ~ctrl.stopped
    decided = self.decide(ctrl, total / jnp.maximum(count, 1).astype(jnp.float32))
    ctrl = jax.tree.map(lambda a, b: jnp.where(act, a, b), decided, ctrl)
    return ctrl.replace(round_sum=jnp.where(over, 0.0, total).astype(jnp.float32),
                        round_count=jnp.where(over, 0, count).astype(jnp.int32))

  def decide(self, ctrl: ControllerState, rate: jax.Array) -> ControllerState:
    """The end-of-round rule, given the round's mean flip rate (docs/algorithms.md): above
    the band raise lambda_W, unless the previous round's raise did not lower the rate by
    decay_auto_min_response: then lambda_W no longer steers it (Adam normalises the decayed
    gradient), so undo that raise and stop; below the band lower lambda_W; in it hold."""
    hi = self.decay_auto_target * self.decay_auto_band
    lo = self.decay_auto_target / self.decay_auto_band
    lam, factor = ctrl.decay, self.decay_auto_rate
    above = rate > hi
    ignored = ctrl.raised & (rate > ctrl.rate_before_raise * (1 - self.decay_auto_min_response))
    undo = above & ignored
    up = above & ~ignored & (lam < self.max_decay)   # at the cap: hold (nothing to check)
    new = jnp.where(undo, ctrl.before_raise,
                    jnp.where(up, jnp.minimum(lam * factor, self.max_decay),
                              jnp.where(rate < lo, jnp.maximum(lam / factor, MIN_DECAY), lam)))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return ctrl.replace(decay=f32(new), before_raise=f32(jnp.where(up, lam, ctrl.before_raise)),
                        rate_before_raise=f32(jnp.where(up, rate, ctrl.rate_before_raise)),
                        last_rate=f32(rate), raised=up, stopped=ctrl.stopped | undo,
                        rounds=ctrl.rounds + 1)

  # -- the loop ---------------------------------------------------------------------------------

  def chores(self, facts):
    chores = super().chores(facts)
    if self.controlled:   # after the last step of the window
      chores.append(chores_lib.Chore(self._log_chosen_decay, name="lambda_W frozen",
                                     due=lambda info: info.next_step == self.controller_window[1]))
    return chores

  def freeze_report(self, ctrl: ControllerState) -> dict[str, float]:
    """What the controller ended with: lambda_W, whether it stopped because the flip rate
    did not respond to a raise, whether its last round's rate was in the band, its rounds."""
    last = float(ctrl.last_rate)
    lo = self.decay_auto_target / self.decay_auto_band
    hi = self.decay_auto_target * self.decay_auto_band
    prefix = base.STATE_METRICS
    return {f"{prefix}decay_chosen": float(ctrl.decay),
            f"{prefix}decay_stopped_unresponsive": float(bool(ctrl.stopped)),
            f"{prefix}decay_band_reached": float(lo <= last <= hi),   # NaN: no round, 0
            f"{prefix}decay_rounds": float(ctrl.rounds)}

  def _log_chosen_decay(self, ctx: chores_lib.Context) -> None:
    ctrl = ctx.state.method_state
    report = self.freeze_report(ctrl)
    chosen, last = report[f"{base.STATE_METRICS}decay_chosen"], float(ctrl.last_rate)
    band = (self.decay_auto_target / self.decay_auto_band,
            self.decay_auto_target * self.decay_auto_band)
    logging.info("step %d: end of the lambda_W warm-up controller (%d rounds); lambda_W frozen "
                 "at %.4g (started at %.4g)", ctx.info.next_step, int(ctrl.rounds), chosen, self.decay)
    if bool(ctrl.stopped):
      # Seen on the tiny Hu et al. recipe (docs/results.md, "Hu et al. 2024"): with the decay fed into
      # Adam, a larger lambda_W stops lowering the flip rate.
      logging.warning(
          "lambda_W warm-up controller stopped: raising lambda_W from %.4g to %.4g did not "
          "lower the flip rate (%s) by %.0f%% (%.3g -> %.3g; band [%.3g, %.3g]): lambda_W no "
          "longer steers it (Adam normalises the decayed gradient). lambda_W went back to "
          "%.4g and is frozen there.", chosen, min(chosen * self.decay_auto_rate,
                                                   self.max_decay),
          self.steer_on, 100 * self.decay_auto_min_response, float(ctrl.rate_before_raise),
          last, *band, chosen)
    elif last > band[1]:
      logging.warning(
          "lambda_W warm-up controller: the flip rate (%s) was still above the band [%.3g, "
          "%.3g] at its last round (%.3g) with lambda_W = %.4g (cap %.4g = %gx the start): "
          "the window ended, or the cap was reached, before the band.", self.steer_on,
          *band, last, chosen, self.max_decay, MAX_GROWTH)
    ctx.write(ctx.info.next_step, report)
