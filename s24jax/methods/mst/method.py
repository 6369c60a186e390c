"""Mixed Sparsity Training (Hu, Li, Huang): dynamic sparse training with Sparsity Variation,
following the authors' code (github.com/hupihe/Mixed-Sparsity-Training, `DST/scheduler.py`,
`sparse_train.py`) by default. docs/algorithms.md, MST, states every rule and option.

The default procedure (every rule is pinned by a hand-computed case in tests/methods/test_mst.py, and
tests/methods/mst_reference.py, an independent NumPy model of the authors' update, gives the same
masks and weights step for step):

- Layers: those matching `sparsity.sparse_layers`. The reference's set is every linear layer
  of every block and the tied LM head / token embedding ('wte', s24jax/nn/sparse_linear.py:
  SparseEmbed: one mask for the lookup and the head); experiments/gpt2_mst.py sets it.
  Forward W~ = mask * W; backward dL/dW := dL/dW~, dense; the optimizer sees only the active
  entries' gradients and pruned weights stay exactly 0.
- Start (`init='random'`): at init every layer prunes int(S_l N_l) entries drawn uniformly at
  random, S_l the Erdos-Renyi sparsity of the schedule's first level; weights outside the
  mask are zeroed (`init_state`).
- Layer sparsities (Erdos-Renyi, the reference's arithmetic): raw_l = (out + in) / (out in),
  one scale eps with sum_l (1 - eps raw_l) N_l = s sum_l N_l, summed in the reference's layer
  order; while eps raw_l > 1 for the largest raw_l, those layers become dense and eps is
  solved again. S_l = 1 - eps raw_l is a float, kept as such.
- Schedule (`schedule='steps'`): piecewise constant, target_sparsity from step 0,
  ultra_sparsity from the start of the second phase, final_sparsity from the third
  (phase_fractions of total_steps); a new level takes effect at the first update at or
  after its start.
- Timing: topology updates at steps Delta, 2 Delta, ... < total_steps (never at step 0). On
  those steps the step's forward/backward gives the growth gradient and **the optimizer step
  is skipped**: no parameter moves, Adam's moments and bias-correction count stay; only the
  learning-rate schedule's count advances, as the reference's lr follows the iteration.
- Counts, per layer (host side, float64, `layer_counts`): with S_l the scheduler's record
  (the nominal ER float before the first update, 1 - n_active / N after), target_S_l the ER
  sparsity of the step's target (or S_l itself when the target is within 1e-4 of the measured
  global sparsity, after the first update),
    delta   = int((target_S_l - S_l) N_l)            (truncated toward 0)
    n_prune = max(int(n_active zeta_t), delta)       (forced pruning inside the drop fraction)
    n_grow  = n_prune - delta
    n_grad  = int(n_grow (r / (r + 1))),  n_rand = n_grow - n_grad
  zeta_t = zeta/2 (1 + cos(pi t / T)) at the update's step t, T = total_steps.
- Update (device side, in `update`): drop the n_prune smallest |W| of the active
  entries; grow the n_grad largest |dL/dW~| of the step's own unclipped gradient among all
  entries not kept, **including those just dropped**; grow n_rand more uniformly at random
  among the rest. A dropped entry grown back keeps its weight; a new one starts at 0. AdamW's
  moments are not touched.
- Ties (the reference leaves them to torch.topk): the lower flat index is dropped first and
  grown first.

Options (each the field of the same name; the reason is in docs/algorithms.md):
  schedule='cosine_ramps'   our three-phase cosine ramps, starting at initial_sparsity
  init='dense' | 'magnitude'  dense start (the paper's prose) | keep the largest |W|
  forced_prune='on_top'     sparsifying prunes floor(zeta_t n) + delta (more churn)
  regrow_dropped=False      regrow only entries inactive before the update
  reset_moments=True        zero Adam's moments at every entry whose mask changed
  count_rounding='round'    per-layer counts round(density N) of the target, exact each time
  train_on_update_step=True  the update step also trains: its optimizer step is taken and the
                            topology then changes with the same gradient (no batch is spent
                            on growth alone)
  grow_ratio=inf            gradient-only growth (the reference code's default grow_mix=False;
                            the paper's Mixed Growing is r = 3)
  anneal_per_phase          restart the drop-fraction cosine in every phase

How it runs: the counts follow from the schedule and the layer shapes alone, so `init` plans
every update of the run on the host (`counts.plan`, in `init_state`) and puts the table of counts in the method
state (`MSTState`); the train step's `update` runs the topology update under lax.cond on
"is step t an update step", reading row t / Delta - 1 of the table, so the step compiles once
and the host never writes into the state. The random draw of step t uses
fold_in(fold_in(state.rng, t), _RNG_TAG): a resumed run makes the updates an uninterrupted
one makes. Hybrid Sparse Attention: a sparse attention pattern during a window of steps
(`model_at`, schedule.attention_at).

The package: schedule.py (step -> level, drop fraction, attention), densities.py (layer
sparsities), counts.py (update counts, the run's plan), topology.py (the on-device update),
plot.py (the schedule plot), method.py (this).
"""
from __future__ import annotations

import dataclasses
import os
from typing import ClassVar, Sequence

import flax
import flax.struct
import jax
import jax.numpy as jnp
import optax
from absl import logging

from s24jax.methods.mst import attention_masks
from s24jax import chores as chores_lib
from s24jax import metrics as metrics_lib
from s24jax import state as state_lib
from s24jax.methods import base
from s24jax.methods import straight_through
from s24jax.methods.mst import counts as counts_lib
from s24jax.methods.mst import densities
from s24jax.methods.mst import plot
from s24jax.methods.mst import schedule
from s24jax.methods.mst import topology

INITS = ("random", "magnitude", "dense")
FORCED_PRUNE = ("inside", "on_top")
COUNT_ROUNDING = ("reference", "round")
_UPDATE_METRICS = ("dropped", "grown_gradient", "grown_random", "regrown_dropped",
                   "changed_fraction")


@flax.struct.dataclass
class MSTState:
  """The method state: the run's update plan, (updates, layers, 3) int32 (n_prune, n_grad,
  n_rand), layers in sparse_layer_paths order (counts.Plan.table)."""
  counts: jax.Array


def _check_choice(field: str, value: str, valid: Sequence[str]) -> None:
  if value not in valid:
    raise ValueError(f"unknown sparsity.mst.{field} {value!r}; valid: {', '.join(valid)}")


@dataclasses.dataclass(frozen=True)
class MST(base.Method, base.OptimizerTransforms, base.ModelPhases, base.DynamicDensity):
  """Its fields are the config block `config.sparsity.mst` (docs/algorithms.md, MST)."""
  structured_24: ClassVar[bool] = False   # unstructured masks: the 'xla' backend only
  update_every: int = 100         # Delta: topology updates at steps Delta, 2 Delta, ... (not 0)
  drop_fraction: float = 0.3      # zeta: drop fraction, cosine-annealed zeta/2 (1 + cos(pi t/T))
  anneal_per_phase: bool = False  # restart the cosine in every sparsity phase (stepwise)
  grow_ratio: float = 3.0         # r: a share int(r/(r+1) n) of regrowth by |gradient|; inf: all
  distribution: str = "erdos_renyi"  # layer sparsities: 'erdos_renyi' or 'uniform'
  # Sparsity Variation over three phases (fractions of total_steps): warm-up at
  # target_sparsity, ultra-sparsification at ultra_sparsity, restoration at final_sparsity.
  # 'steps': piecewise constant (the reference); 'cosine_ramps': each phase ramps from the
  # previous level (initial_sparsity before warm-up) over its first ramp_fraction.
  schedule: str = "steps"
  initial_sparsity: float = 0.0   # cosine_ramps only: the level at step 0
  target_sparsity: float = 0.8
  ultra_sparsity: float = 0.9
  final_sparsity: float = 0.7
  phase_fractions: tuple[float, ...] = (0.25, 0.5, 0.25)
  ramp_fraction: float = 0.5      # cosine_ramps only
  init: str = "random"            # the step-0 mask: 'random' | 'magnitude' | 'dense'
  forced_prune: str = "inside"    # 'inside' the drop fraction (reference) | 'on_top' of it
  regrow_dropped: bool = True     # regrowth may pick entries dropped in the same update
  reset_moments: bool = False     # zero Adam's moments where the mask changed
  count_rounding: str = "reference"   # int((target_S - S) N) (reference) | 'round'
  train_on_update_step: bool = False  # False: the update step skips the optimizer step
  # Hybrid Sparse Attention: this pattern during [start, end) (fractions of total_steps),
  # model.attention outside; 'causal' turns it off.
  sparse_attention: str = "causal"
  sparse_attention_start: float = 0.25
  sparse_attention_end: float = 0.75
  # The run's total_steps (set by `configure`; the schedule's phases are fractions of it).
  total_steps: int = dataclasses.field(default=0, metadata=base.INTERNAL)

  def __post_init__(self):
    base.check_positive_int("sparsity.mst.update_every", self.update_every)
    _check_choice("distribution", self.distribution, densities.DISTRIBUTIONS)
    _check_choice("schedule", self.schedule, schedule.SCHEDULES)
    _check_choice("init", self.init, INITS)
    _check_choice("forced_prune", self.forced_prune, FORCED_PRUNE)
    _check_choice("count_rounding", self.count_rounding, COUNT_ROUNDING)
    if not 0.0 <= self.drop_fraction <= 1.0:
      raise ValueError(f"sparsity.mst.drop_fraction (zeta) must be in [0, 1], got "
                       f"{self.drop_fraction}")
    if self.grow_ratio < 0:
      raise ValueError(f"sparsity.mst.grow_ratio (r) must be >= 0, got {self.grow_ratio}")
    for name in ("initial_sparsity", "target_sparsity", "ultra_sparsity", "final_sparsity"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"sparsity.mst.{name} must be in [0, 1), got {getattr(self, name)}")
    fr = tuple(self.phase_fractions)
    if len(fr) != 3 or min(fr) < 0 or abs(sum(fr) - 1.0) > 1e-6:
      raise ValueError("sparsity.mst.phase_fractions must be 3 non-negative fractions "
                       f"({', '.join(schedule.PHASES)}) summing to 1, got {fr}")
    if not 0.0 <= self.ramp_fraction <= 1.0:
      raise ValueError(f"sparsity.mst.ramp_fraction must be in [0, 1], got {self.ramp_fraction}")
    if not 0.0 <= self.sparse_attention_start <= self.sparse_attention_end <= 1.0:
      raise ValueError("need 0 <= sparsity.mst.sparse_attention_start <= "
                       "sparse_attention_end <= 1, got "
                       f"{self.sparse_attention_start}, {self.sparse_attention_end}")

  def configure(self, facts):
    if facts.scan_layers:   # per-layer counts need per-layer kernels
      raise ValueError(f"sparsity.method={self.name!r} needs model.scan_layers=False "
                       "(its topology updates count weights per layer)")
    if facts.backend != "xla":   # fast backends assume 2:4; these masks are not
      raise ValueError(f"sparsity.method={self.name!r} (unstructured masks) needs "
                       f"sparsity.backend='xla', got {facts.backend!r}")
    attention_masks.check_pattern(self.sparse_attention, facts.attention_stride)
    if not {"*/attn/*", "*/mlp/*", facts.head} <= set(facts.sparse_layers):
      logging.warning("mst: sparsity.sparse_layers=%s is not the reference's set (every linear "
                      "layer and the LM head: '*/attn/*', '*/mlp/*', %r; "
                      "experiments/gpt2_mst.py)", facts.sparse_layers, facts.head)
    return dataclasses.replace(self, total_steps=facts.total_steps)

  # -- the model: mask in the state, dense gradient, pruned weights stay 0 ---------------------

  def init_layer(self, kernel):
    return {"mask": jnp.ones(kernel.shape, bool)}   # the start is set in init_state

  def mask(self, kernel, layer):
    return layer["mask"] if "mask" in layer else jnp.ones(kernel.shape, bool)

  def project(self, kernel, layer):
    """mask * W, straight through: the dense gradient reaches the pruned entries too (MST
    grows where |dL/dW~| is largest); the 'raw' optimizer transform then keeps only the
    active entries' gradients, so pruned weights stay exactly 0 under Adam."""
    return straight_through.masked(kernel, layer["mask"])

  def model_at(self, step, model_cfg):
    pattern = schedule.attention_at(self, step, self.total_steps, model_cfg.attention)
    return dataclasses.replace(model_cfg, attention=pattern)

  # -- the plan ---------------------------------------------------------------------------------

  def plan(self, shapes) -> counts_lib.Plan:
    """The run's updates over the sparse layers `shapes` ({name: (out, in)})."""
    ordered = tuple((k, tuple(shapes[k])) for k in densities.reference_order(shapes))
    return counts_lib.plan(self, ordered, self.total_steps)

  def update_due(self, step, total_steps: int | None = None):
    """Whether step `step` (an index; a host int, or traced inside the train step) updates
    the topology: steps Delta, 2 Delta, ... strictly below total_steps. The one statement of
    the rule: the host's plan and chores and the device's `update` all ask it."""
    total = self.total_steps if total_steps is None else total_steps
    return (step > 0) & (step < total) & (step % int(self.update_every) == 0)

  def active_weights(self, step, shapes):
    plan = self.plan(shapes)
    if step == 0:
      nnz = plan.first
    else:
      nnz = plan.active_after().get(step - 1)   # the update of step t changes step t + 1
    return nnz, self.update_due(step)

  # -- the train state and the step ------------------------------------------------------------

  def init_state(self, params, sparsity, rng):
    """The step-0 mask (init: 'random', 'magnitude' or 'dense') at the first level of the
    schedule, weights outside it zeroed; and the method state, the run's plan. Layer j of
    sparse_layer_paths draws its random mask from fold_in(rng, j): the entries with the
    int(S_l N_l) smallest random_keys are pruned."""
    paths = state_lib.sparse_layer_paths(sparsity)
    if not paths:
      raise ValueError(f"sparsity.method={self.name!r} but no layer matches "
                       "sparsity.sparse_layers")
    if self.total_steps <= 0:
      raise ValueError("MST.init_state needs the run's total_steps: build the method with "
                       "registry.from_config(config) (MST.configure)")
    shapes = densities.layer_shapes(params, sparsity)
    plan = self.plan(shapes)
    params = flax.core.unfreeze(jax.tree.map(lambda x: x, params))
    new_masks = {}
    for j, path in enumerate(paths):
      layer = state_lib.get_path(params, path)
      name = state_lib.weight_name(layer)
      w = layer[name]
      zeros = w.size - plan.first[state_lib.layer_name(path)]
      if self.init == "random":
        score = topology.random_keys(jax.random.fold_in(rng, j), w.size)
      else:
        score = jnp.abs(w.reshape(-1))
      mask = (topology.ranks(score) >= zeros).reshape(w.shape)
      layer[name] = jnp.where(mask, w, 0)
      new_masks[path] = mask
    table = plan.table([state_lib.layer_name(p) for p in paths])
    return params, state_lib.with_masks(sparsity, new_masks), MSTState(counts=jnp.asarray(table))

  def optimizer_transforms(self, placement, is_sparse):
    """On the raw gradients (before clipping): only active weights learn; the dense gradient
    reaches pruned ones only in the topology update."""
    del is_sparse
    if placement != "raw":
      return []

    def update_fn(updates, state, params=None, *, method=None, sparsity=None, **extra):
      del params, extra
      if method is None or not method.sparse:   # dense fine-tuning: every weight learns
        return updates, state
      return state_lib.mask_sparse_kernels(updates, sparsity), state

    return [optax.GradientTransformationExtraArgs(lambda _: optax.EmptyState(), update_fn)]

  def update(self, before, after, grads, info):
    """Pruned weights stay 0; on an update step (t = Delta, 2 Delta, ... < total_steps, t the
    step index), new masks from the step's raw gradient and the weights before the step
    (after it with train_on_update_step), and the optimizer step undone except for the lr
    schedule count (the reference skips it)."""
    after = after.replace(params=state_lib.mask_sparse_kernels(after.params, after.sparsity))
    step = info.step
    due = self.update_due(step)
    table = before.method_state.counts
    row = table[jnp.clip(step // self.update_every - 1, 0, table.shape[0] - 1)]
    paths = state_lib.sparse_layer_paths(before.sparsity)
    start = after.params if self.train_on_update_step else before.params
    old = [state_lib.get_path(before.sparsity, p)["mask"] for p in paths]
    key = topology.update_rng(before)

    def drop_and_grow(_):
      news, totals = [], {k: jnp.zeros((), jnp.int32) for k in _UPDATE_METRICS[:-1]}
      changed, size = jnp.zeros((), jnp.int32), 0
      for i, path in enumerate(paths):
        new, info = topology.update_layer_mask(
            base.kernel_at(start, path), old[i], base.kernel_at(grads, path), row[i, 0],
            row[i, 1], row[i, 2], topology.random_keys(jax.random.fold_in(key, i), old[i].size),
            regrow_dropped=self.regrow_dropped)
        news.append(new)
        for k in totals:
          totals[k] = totals[k] + jnp.sum(info[k], dtype=jnp.int32)
        changed = changed + jnp.sum(new != old[i], dtype=jnp.int32)
        size += new.size
      out = {f"mst/{k}": v.astype(jnp.float32) for k, v in totals.items()}
      out["mst/changed_fraction"] = changed.astype(jnp.float32) / max(size, 1)
      return news, out

    def keep(_):
      return list(old), {f"mst/{k}": jnp.float32(jnp.nan) for k in _UPDATE_METRICS}

    news, metrics = jax.lax.cond(due, drop_and_grow, keep, None)
    params, opt_state = after.params, after.opt_state
    if not self.train_on_update_step:   # the reference skips the optimizer step
      params = topology.select(due, before.params, params)
      opt_state = topology.select(due, topology.skipped_opt_state(before.opt_state, opt_state),
                                  opt_state)
    params = flax.core.unfreeze(jax.tree.map(lambda x: x, params))
    reset = jax.tree.map(lambda _: jnp.zeros((), bool), params)
    for path, new, o in zip(paths, news, old):
      layer = state_lib.get_path(params, path)
      name = state_lib.weight_name(layer)
      # Kept and dropped-and-regrown weights keep their value; new ones start at 0.
      layer[name] = jnp.where(new & o, layer[name], 0)
      state_lib.get_path(reset, path)[name] = new != o
    if self.reset_moments:
      opt_state = topology.reset_params_shaped(opt_state, params, reset)
    sparsity = state_lib.with_masks(after.sparsity, dict(zip(paths, news)))
    return after.replace(params=params, opt_state=opt_state, sparsity=sparsity), metrics

  # -- the loop ---------------------------------------------------------------------------------

  def chores(self, facts):
    def log_plan(ctx: chores_lib.Context) -> None:
      """What the update of this step does, as planned (its device metrics say what it did)."""
      if not ctx.sparse_phase:   # dense fine-tuning: no more updates
        return
      plan = self.plan(densities.layer_shapes(ctx.state.params, ctx.state.sparsity))
      ctx.write(ctx.info.step, plan.scalars[plan.steps.index(ctx.info.step)])

    def plot_schedule(ctx: chores_lib.Context) -> None:
      records = metrics_lib.read_jsonl(ctx.metrics_path)
      steps, sparsity = metrics_lib.series(records, "mst/sparsity")
      plot.plot_schedule(self, facts.total_steps, facts.attention_stride,
                         os.path.join(ctx.workdir, "mst_schedule.png"),
                         measured={"step": steps, "sparsity": sparsity})

    return [*super().chores(facts),
            chores_lib.Chore(log_plan, before_step=True,
                             due=lambda info: self.update_due(info.step),
                             name="MST topology update plan"),
            chores_lib.Chore(plot_schedule, due=lambda info: info.next_step == facts.total_steps,
                             name="MST schedule plot")]
