"""Mixed Sparsity Training (Hu, Li, Huang): dynamic sparse training with Sparsity Variation,
following the authors' code (github.com/hupihe/Mixed-Sparsity-Training, `DST/scheduler.py`,
`sparse_train.py`) by default. docs/algorithms.md, MST, states every rule and option.

The default procedure (every rule is pinned by a hand-computed case in tests/test_mst.py, and
tests/mst_reference.py, an independent NumPy model of the authors' update, gives the same
masks and weights step for step):

- Layers: those matching `sparsity.sparse_layers`. The reference's set is every linear layer
  of every block and the tied LM head / token embedding ('wte', s24jax/sparse_linear.py:
  SparseEmbed: one mask for the lookup and the head); experiments/gpt2_mst.py sets it.
  Forward W~ = mask * W; backward dL/dW := dL/dW~, dense; the optimizer sees only the active
  entries' gradients and pruned weights stay exactly 0.
- Start (`init='random'`): at init every layer prunes int(S_l N_l) entries drawn uniformly at
  random, S_l the Erdos-Renyi sparsity of the schedule's first level; weights outside the
  mask are zeroed (`init_train`).
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
- Update (device side, in `finish_step`): drop the n_prune smallest |W| of the active
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

How it runs: a before-step hook (host) computes the counts of a due step and writes them with
a flag into the state (`sparsity['mst']`); the train step's `finish_step` then runs the update
under lax.cond on that flag, so the step compiles once. The random draw of step t uses
fold_in(fold_in(state.rng, t), _RNG_TAG): a resumed run makes the updates an uninterrupted
one makes. Hybrid Sparse Attention: a sparse attention pattern during a window of steps,
`attention_at`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any, ClassVar, Mapping, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from s24jax import attention_masks
from s24jax import hooks as hooks_lib
from s24jax import metrics as metrics_lib
from s24jax import state as state_lib
from s24jax.methods import base
from s24jax.state import TrainState

DISTRIBUTIONS = ("erdos_renyi", "uniform")
PHASES = ("warm-up", "ultra-sparsification", "restoration")
SCHEDULES = ("steps", "cosine_ramps")
INITS = ("random", "magnitude", "dense")
FORCED_PRUNE = ("inside", "on_top")
COUNT_ROUNDING = ("reference", "round")
# After the first update, a target within this distance of the measured global sparsity
# keeps every layer's sparsity (no forced pruning or growth), as the reference does.
SAME_TARGET_TOL = 1e-4
HEAD = "wte"          # the tied token embedding / LM head, when it is a sparse layer
_RNG_TAG = 0x6D7374   # 'mst': decorrelates the growth rng from other uses of the step rng
_UPDATE_METRICS = ("dropped", "grown_gradient", "grown_random", "regrown_dropped",
                   "changed_fraction")

Path = tuple[str, ...]
Shapes = Mapping[str, tuple[int, int]]


# ---------------------------------------------------------------------------------------------
# Schedules: step -> target sparsity, drop fraction, attention pattern (host-side floats).


def phase_bounds(mst_cfg, total_steps: int) -> list[tuple[int, int]]:
  """[start, end) steps of the warm-up, ultra-sparsification and restoration phases."""
  ends = np.rint(np.cumsum(tuple(mst_cfg.phase_fractions)) * total_steps).astype(int)
  ends[-1] = total_steps
  starts = np.concatenate([[0], ends[:-1]])
  return [(int(s), int(e)) for s, e in zip(starts, ends)]


def phase_at(mst_cfg, step: int, total_steps: int) -> int:
  """Index into PHASES of the phase `step` is in (steps past the end: the last phase)."""
  for i, (_, end) in enumerate(phase_bounds(mst_cfg, total_steps)):
    if step < end:
      return i
  return len(PHASES) - 1


def _cosine_ramp(u: float) -> float:
  """0 at u <= 0, 1 at u >= 1, half a cosine in between (smooth at both ends)."""
  u = min(max(u, 0.0), 1.0)
  return 0.5 * (1.0 - math.cos(math.pi * u))


def target_sparsity(mst_cfg, step: int, total_steps: int) -> float:
  """The global target sparsity at `step` (Sparsity Variation).

  'steps' (the reference's piecewise-constant schedule): the level of the phase `step` is in
  (warm-up: target_sparsity, ultra: ultra_sparsity, restoration: final_sparsity).
  'cosine_ramps': phase i moves from the level the previous phase ended at to its own level
  (before warm-up: initial_sparsity) by a cosine ramp over its first `ramp_fraction`, then
  holds it.
  """
  levels = (mst_cfg.initial_sparsity, mst_cfg.target_sparsity, mst_cfg.ultra_sparsity,
            mst_cfg.final_sparsity)
  i = phase_at(mst_cfg, step, total_steps)
  if mst_cfg.schedule == "steps":
    return float(levels[i + 1])
  start, end = phase_bounds(mst_cfg, total_steps)[i]
  ramp = mst_cfg.ramp_fraction * (end - start)
  u = (step - start) / ramp if ramp > 0 else 1.0
  return float(levels[i] + (levels[i + 1] - levels[i]) * _cosine_ramp(u))


def drop_fraction(mst_cfg, step: int, total_steps: int) -> float:
  """zeta_t = zeta/2 (1 + cos(pi (t - start) / (end - start))): over the whole run (start 0,
  end total_steps), or over each phase with `anneal_per_phase` (the reference's stepwise
  annealing)."""
  start, end = 0, total_steps
  if mst_cfg.anneal_per_phase:
    start, end = phase_bounds(mst_cfg, total_steps)[phase_at(mst_cfg, step, total_steps)]
  if end <= start:
    return 0.0
  return mst_cfg.drop_fraction / 2 * (1 + math.cos(math.pi * (step - start) / (end - start)))


def grow_split(n_grow: int, grow_ratio: float) -> tuple[int, int]:
  """(by gradient, at random) = (int(n_grow (r / (r + 1))), the rest): truncated, as the
  reference does (n_grow = 2, r = 3 gives 1 and 1). r = inf: all by gradient."""
  r = float(grow_ratio)
  if math.isinf(r):
    return n_grow, 0
  n_grad = int(n_grow * (r / (r + 1)))
  return n_grad, n_grow - n_grad


def attention_window(mst_cfg, total_steps: int) -> tuple[int, int]:
  """[start, end) steps of the sparse-attention window (empty if it is 'causal')."""
  m, total = mst_cfg, total_steps
  if m.sparse_attention == "causal":
    return (0, 0)
  return (int(round(m.sparse_attention_start * total)), int(round(m.sparse_attention_end * total)))


def attention_at(mst_cfg, step: int, total_steps: int, outside: str) -> str:
  """The attention pattern of `step`: sparse_attention inside the window, else `outside`
  (model.attention): Hybrid Sparse Attention."""
  start, end = attention_window(mst_cfg, total_steps)
  return mst_cfg.sparse_attention if start <= step < end else outside


# ---------------------------------------------------------------------------------------------
# Layers and their sparsities (host side, float64 as in the reference).

_BLOCK_ORDER = ("attn/qkv", "attn/out", "mlp/fc", "mlp/proj")


def reference_order(names) -> list[str]:
  """Layer names in the reference's order (its module registration order): per block
  qkv, out, fc, proj, blocks in order, then the tied head 'wte'. The Erdos-Renyi sums run in
  this order, so the floats (and the counts truncated from them) are the reference's."""
  def key(name):
    match = re.fullmatch(r"h_(\d+)/(.+)", name)
    if match:
      rest = match.group(2)
      pos = _BLOCK_ORDER.index(rest) if rest in _BLOCK_ORDER else len(_BLOCK_ORDER)
      return (0, int(match.group(1)), pos, rest)
    return (2 if name == HEAD else 1, 0, 0, name)
  return sorted(names, key=key)


def erdos_renyi_sparsities(shapes: Shapes, sparsity: float) -> dict[str, float]:
  """Per-layer sparsity S_l of a global `sparsity`, Erdos-Renyi, in the reference's float
  arithmetic (`shapes` in reference order, (out, in) each).

  raw_l = (out + in) / (out in). eps = (sum_{l not dense} N_l (1 - s) - sum_{l dense} N_l s)
  / sum_{l not dense} raw_l N_l; while the largest raw_l among the others has eps raw_l > 1,
  every layer with that raw value becomes dense and eps is solved again. S_l = 1 - eps raw_l
  (0 for dense layers).
  """
  dense: set[str] = set()
  while True:
    rhs, divisor, raw = 0.0, 0.0, {}
    for name, (o, i) in shapes.items():
      n = int(o) * int(i)
      if name in dense:
        rhs -= n * sparsity
      else:
        rhs += n * (1 - sparsity)
        raw[name] = (int(o) + int(i)) / n
        divisor += raw[name] * n
    if not raw:
      raise ValueError(f"no Erdos-Renyi layer sparsities reach global sparsity {sparsity}")
    eps = rhs / divisor
    top = max(raw.values())
    if top * eps > 1:
      dense |= {name for name, r in raw.items() if r == top}
      continue
    return {name: 0.0 if name in dense else 1 - raw[name] * eps for name in shapes}


def layer_sparsities(shapes: Shapes, sparsity: float,
                     distribution: str = "erdos_renyi") -> dict[str, float]:
  """Per-layer sparsities of a global `sparsity` under `distribution` (DISTRIBUTIONS)."""
  if distribution == "erdos_renyi":
    return erdos_renyi_sparsities(shapes, sparsity)
  if distribution == "uniform":
    return {k: float(sparsity) for k in shapes}
  raise ValueError(f"unknown mst.distribution {distribution!r}; valid: {', '.join(DISTRIBUTIONS)}")


def layer_shapes(params: Any, sparsity: Any) -> dict[str, tuple[int, int]]:
  """(out, in) of every sparse layer ('wte': (vocab, C)), by name, in reference order."""
  shapes = {state_lib.layer_name(p): tuple(base.kernel_at(params, p).shape)
            for p in state_lib.sparse_layer_paths(sparsity)}
  return {k: shapes[k] for k in reference_order(shapes)}


@dataclasses.dataclass(frozen=True)
class LayerCounts:
  """One layer's update: drop n_prune, grow n_grad by gradient and n_rand at random."""
  n_prune: int
  n_grad: int
  n_rand: int
  n_before: int
  n_after: int


def layer_counts(m: "MST", n_total: int, n_ones: int, zeta_t: float, s_before: float,
                 s_after: float) -> LayerCounts:
  """The counts of one layer (module docstring, 'Counts'; options forced_prune,
  count_rounding, regrow_dropped, grow_ratio)."""
  if m.count_rounding == "reference":
    delta = int((s_after - s_before) * n_total)        # truncated toward 0, from float64
  else:
    delta = n_ones - min(n_total, max(0, math.floor((1 - s_after) * n_total + 0.5)))
  swap = int(n_ones * zeta_t)
  if m.forced_prune == "inside":
    n_prune = max(swap, delta)
    n_grow = n_prune - delta
  else:   # on_top: a capped swap plus the whole change
    k = n_ones - delta
    room = max(min(n_ones, k, n_total - max(n_ones, k)), 0)
    swap = min(max(swap, 0), room)
    n_prune = swap + max(delta, 0)
    n_grow = swap + max(-delta, 0)
  if not m.regrow_dropped and n_grow > n_total - n_ones:   # only inactive entries can grow
    n_grow = n_total - n_ones
    n_prune = n_grow + delta
  n_prune = min(max(n_prune, 0), n_ones)
  n_grow = min(max(n_grow, 0), n_total - (n_ones - n_prune))
  n_grad, n_rand = grow_split(n_grow, m.grow_ratio)
  return LayerCounts(n_prune, n_grad, n_rand, n_ones, n_ones - n_prune + n_grow)


def initial_counts(m: "MST", shapes: Shapes, total_steps: int) -> dict[str, int]:
  """Active weights per layer at step 0 (init: N - int(S_l N) per layer, or dense)."""
  level = target_sparsity(m, 0, total_steps)
  if m.init == "dense" or level == 0:
    return {k: int(o) * int(i) for k, (o, i) in shapes.items()}
  s = layer_sparsities(shapes, level, m.distribution)
  return {k: int(o) * int(i) - int(s[k] * (int(o) * int(i))) for k, (o, i) in shapes.items()}


def plan_update(m: "MST", shapes: Shapes, n_active: Mapping[str, int], step: int,
                total_steps: int) -> tuple[dict[str, LayerCounts], dict[str, float]]:
  """The counts of the update at `step` from the layers' active counts before it, with the
  scheduler's bookkeeping (reconstructed from the counts, so a resumed run plans the same):
  per-layer records S_l are the nominal floats of the initial level until the first update
  (step Delta), then 1 - n_active / N. Returns ({layer: LayerCounts}, host scalars)."""
  sizes = {k: int(o) * int(i) for k, (o, i) in shapes.items()}
  target = target_sparsity(m, step, total_steps)
  zeta_t = drop_fraction(m, step, total_steps)
  updated_before = step > m.update_every
  if updated_before:
    s_now = {k: 1 - n_active[k] / sizes[k] for k in shapes}
    measured = 1 - sum(n_active[k] for k in shapes) / sum(sizes.values())
  elif m.init == "dense" or target_sparsity(m, 0, total_steps) == 0:
    s_now = {k: 0.0 for k in shapes}
    measured = 0.0
  else:
    measured = target_sparsity(m, 0, total_steps)
    s_now = layer_sparsities(shapes, measured, m.distribution)
  if updated_before and abs(target - measured) < SAME_TARGET_TOL:
    s_next = dict(s_now)
  else:
    s_next = layer_sparsities(shapes, target, m.distribution)
  counts = {k: layer_counts(m, sizes[k], int(n_active[k]), zeta_t, s_now[k], s_next[k])
            for k in shapes}
  after = sum(c.n_after for c in counts.values())
  scalars = {"mst/target_sparsity": target, "mst/drop_fraction": zeta_t,
             "mst/sparsity": 1 - after / sum(sizes.values()),
             "mst/n_prune": float(sum(c.n_prune for c in counts.values())),
             "mst/n_grow": float(sum(c.n_grad + c.n_rand for c in counts.values()))}
  return counts, scalars


@functools.lru_cache(maxsize=16)
def _count_history(m: "MST", shapes: tuple[tuple[str, tuple[int, int]], ...],
                   total_steps: int) -> tuple[dict[str, int], dict[int, dict[str, int]]]:
  """(counts at step 0, {update step: counts after it}) of a whole run: the counts follow
  from the schedule alone, so the FLOP plan is what the run does."""
  shapes_d = dict(shapes)
  n = initial_counts(m, shapes_d, total_steps)
  first = dict(n)
  after = {}
  for step in range(m.update_every, total_steps, m.update_every):
    counts, _ = plan_update(m, shapes_d, n, step, total_steps)
    n = {k: c.n_after for k, c in counts.items()}
    after[step] = dict(n)
  return first, after


# ---------------------------------------------------------------------------------------------
# The topology update of one layer (pure jnp; counts may be traced).


def _ranks(key: jax.Array) -> jax.Array:
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
  dropped = m & (_ranks(jnp.where(m, a, jnp.inf)) < n_prune)
  kept = m & ~dropped
  candidates = ~kept if regrow_dropped else ~m
  g = jnp.abs(grad.reshape(-1).astype(jnp.float32))                          # (D,)
  grown_gradient = candidates & (_ranks(jnp.where(candidates, -g, jnp.inf)) < n_grad)
  rest = candidates & ~grown_gradient
  grown_random = rest & (_ranks(jnp.where(rest, u, jnp.uint32(0xFFFFFFFF))) < n_rand)
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
  is_params = lambda x: jax.tree.structure(x) == treedef   # pylint: disable=unnecessary-lambda-assignment

  def one(sub):
    if not is_params(sub):
      return sub
    return jax.tree.map(lambda v, r: jnp.where(r, jnp.zeros_like(v), v), sub, reset)

  return jax.tree.map(one, tree, is_leaf=is_params)


def skipped_opt_state(old: Any, new: Any) -> Any:
  """The optimizer state of a skipped step: `old`, except that learning-rate schedule counts
  advance (the reference's lr follows the iteration, its Adam does not step)."""
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)   # pylint: disable=unnecessary-lambda-assignment
  return jax.tree.map(lambda o, n: n if is_schedule(o) else o, old, new, is_leaf=is_schedule)


def update_rng(state: TrainState) -> jax.Array:
  return jax.random.fold_in(jax.random.fold_in(state.rng, state.step), _RNG_TAG)


def _select(pred, a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


# ---------------------------------------------------------------------------------------------
# The projection: mask from the state, dense gradient.


@jax.custom_vjp
def masked_dense_grad(w: jax.Array, mask: jax.Array) -> jax.Array:
  """Forward W~ = mask * W (any unstructured bool mask); backward dL/dW := dL/dW~, dense.

  The dense gradient reaches the pruned entries too: MST grows connections where |dL/dW~|
  is largest. `MST.gradients` then keeps only the active entries' gradients for the
  optimizer (so pruned weights stay exactly 0 under Adam); the topology update reads the
  dense one (`finish_step`'s raw gradients).
  """
  return jnp.where(mask, w, 0)


def _masked_dense_grad_fwd(w, mask):
  return masked_dense_grad(w, mask), None


def _masked_dense_grad_bwd(_, g):
  return g, None   # the mask is a bool input: no cotangent


masked_dense_grad.defvjp(_masked_dense_grad_fwd, _masked_dense_grad_bwd)


# ---------------------------------------------------------------------------------------------
# The method.


def _check_choice(field: str, value: str, valid: Sequence[str]) -> None:
  if value not in valid:
    raise ValueError(f"unknown sparsity.mst.{field} {value!r}; valid: {', '.join(valid)}")


@dataclasses.dataclass(frozen=True)
class MST(base.Method):
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
    _check_choice("distribution", self.distribution, DISTRIBUTIONS)
    _check_choice("schedule", self.schedule, SCHEDULES)
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
                       f"({', '.join(PHASES)}) summing to 1, got {fr}")
    if not 0.0 <= self.ramp_fraction <= 1.0:
      raise ValueError(f"sparsity.mst.ramp_fraction must be in [0, 1], got {self.ramp_fraction}")
    if not 0.0 <= self.sparse_attention_start <= self.sparse_attention_end <= 1.0:
      raise ValueError("need 0 <= sparsity.mst.sparse_attention_start <= "
                       "sparse_attention_end <= 1, got "
                       f"{self.sparse_attention_start}, {self.sparse_attention_end}")

  def configure(self, config):
    if config.model.get("scan_layers", False):   # per-layer counts need per-layer kernels
      raise ValueError(f"sparsity.method={self.name!r} needs model.scan_layers=False "
                       "(its topology updates count weights per layer)")
    if config.sparsity.backend != "xla":   # fast backends assume 2:4; these masks are not
      raise ValueError(f"sparsity.method={self.name!r} (unstructured masks) needs "
                       f"sparsity.backend='xla', got {config.sparsity.backend!r}")
    attention_masks.check_pattern(self.sparse_attention, config.model.attention_stride)
    layers = tuple(config.sparsity.sparse_layers)
    if not {"*/attn/*", "*/mlp/*", HEAD} <= set(layers):
      logging.warning("mst: sparsity.sparse_layers=%s is not the reference's set (every linear "
                      "layer and the tied head: '*/attn/*', '*/mlp/*', 'wte'; "
                      "experiments/gpt2_mst.py)", layers)
    return dataclasses.replace(self, total_steps=int(config.total_steps))

  # -- the step: mask in the state, dense gradient, pruned weights stay 0 ----------------------

  def init_layer(self, kernel):
    return {"mask": jnp.ones(kernel.shape, bool)}   # the start is set in init_train

  def mask(self, kernel, layer):
    return layer["mask"] if "mask" in layer else jnp.ones(kernel.shape, bool)

  def project(self, kernel, layer):
    return masked_dense_grad(kernel, layer["mask"])

  def gradients(self, grads, sparsity):
    # Only active weights learn; the dense gradient reaches pruned ones only in the update.
    return state_lib.mask_sparse_kernels(grads, sparsity)

  def after_update(self, params, sparsity, step):
    del step   # the mask changes only in topology updates (finish_step)
    return state_lib.mask_sparse_kernels(params, sparsity), sparsity, {}

  def init_train(self, params, sparsity, rng):
    """The step-0 mask (init: 'random', 'magnitude' or 'dense') at the first level of the
    schedule, weights outside it zeroed; and the method state {'due', 'counts'}. Layer j of
    sparse_layer_paths draws its random mask from fold_in(rng, j): the entries with the
    int(S_l N_l) smallest random_keys are pruned."""
    paths = state_lib.sparse_layer_paths(sparsity)
    if not paths:
      raise ValueError(f"sparsity.method={self.name!r} but no layer matches "
                       "sparsity.sparse_layers")
    if self.total_steps <= 0:
      raise ValueError("MST.init_train needs the run's total_steps: build the method with "
                       "methods.from_config(config) (MST.configure)")
    shapes = layer_shapes(params, sparsity)
    n_active = initial_counts(self, shapes, self.total_steps)
    params = flax.core.unfreeze(jax.tree.map(lambda x: x, params))
    new_masks = {}
    for j, path in enumerate(paths):
      layer = state_lib.get_path(params, path)
      name = state_lib.weight_name(layer)
      w = layer[name]
      zeros = w.size - n_active[state_lib.layer_name(path)]
      if self.init == "random":
        score = random_keys(jax.random.fold_in(rng, j), w.size)
      else:
        score = jnp.abs(w.reshape(-1))
      mask = (_ranks(score) >= zeros).reshape(w.shape)
      layer[name] = jnp.where(mask, w, 0)
      new_masks[path] = mask
    sparsity = state_lib.with_masks(sparsity, new_masks)
    sparsity[self.name] = {"due": jnp.zeros((), bool),
                           "counts": jnp.zeros((len(paths), 3), jnp.int32)}
    return params, sparsity

  def finish_step(self, state, new_state, grads, metrics):
    """On a due step (flag set by the host hook): new masks from the step's raw gradient and
    the weights before the step (after it with train_on_update_step), and the optimizer step
    undone except for the lr schedule count. Other steps: unchanged."""
    own = state.sparsity[self.name]
    due = own["due"]
    paths = state_lib.sparse_layer_paths(state.sparsity)
    before = new_state.params if self.train_on_update_step else state.params
    old = [state_lib.get_path(state.sparsity, p)["mask"] for p in paths]
    key = update_rng(state)

    def topology(_):
      news, totals = [], {k: jnp.zeros((), jnp.int32) for k in _UPDATE_METRICS[:-1]}
      changed, size = jnp.zeros((), jnp.int32), 0
      for i, path in enumerate(paths):
        counts = own["counts"][i]
        new, info = update_layer_mask(base.kernel_at(before, path), old[i],
                                      base.kernel_at(grads, path), counts[0], counts[1],
                                      counts[2], random_keys(jax.random.fold_in(key, i),
                                                             old[i].size),
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

    news, update_metrics = jax.lax.cond(due, topology, keep, None)
    params, opt_state = new_state.params, new_state.opt_state
    if not self.train_on_update_step:   # the reference skips the optimizer step
      params = _select(due, state.params, params)
      opt_state = _select(due, skipped_opt_state(state.opt_state, opt_state), opt_state)
    params = flax.core.unfreeze(jax.tree.map(lambda x: x, params))
    reset = jax.tree.map(lambda _: jnp.zeros((), bool), params)
    for path, new, o in zip(paths, news, old):
      layer = state_lib.get_path(params, path)
      name = state_lib.weight_name(layer)
      # Kept and dropped-and-regrown weights keep their value; new ones start at 0.
      layer[name] = jnp.where(new & o, layer[name], 0)
      state_lib.get_path(reset, path)[name] = new != o
    if self.reset_moments:
      opt_state = reset_params_shaped(opt_state, params, reset)
    sparsity = state_lib.with_masks(new_state.sparsity, dict(zip(paths, news)))
    sparsity[self.name] = {"due": jnp.zeros((), bool), "counts": own["counts"]}
    return (new_state.replace(params=params, opt_state=opt_state, sparsity=sparsity),
            {**metrics, **update_metrics})

  # -- the loop: topology updates, attention windows, FLOPs ------------------------------------

  def model_at(self, step, model_cfg, config):
    model_cfg = super().model_at(step, model_cfg, config)
    pattern = attention_at(self, step, config.total_steps, config.model.attention)
    return dataclasses.replace(model_cfg, attention=pattern)

  def update_due(self, step: int, total_steps: int) -> bool:
    """Topology updates at steps Delta, 2 Delta, ... strictly below total_steps."""
    return 0 < step < total_steps and step % int(self.update_every) == 0

  def flop_profile(self, step, shapes, config):
    total = config.total_steps
    first, after = _count_history(self, tuple((k, tuple(shapes[k]))
                                              for k in reference_order(shapes)), total)
    if step == 0:
      nnz = first
    else:
      nnz = after.get(step - 1)   # the update of step t changes the masks of step t + 1
    return nnz, self.update_due(step, total)

  def hooks(self, config):
    total = config.total_steps
    expected = {}   # active counts the last update left (checked at the next one)

    def prepare(run):
      if run.model_cfg.sparsity.method != self:   # dense fine-tuning: no more updates
        return
      state = run.state
      paths = state_lib.sparse_layer_paths(state.sparsity)
      n_active = jax.device_get({state_lib.layer_name(p): jnp.sum(
          state_lib.get_path(state.sparsity, p)["mask"], dtype=jnp.int32) for p in paths})
      n_active = {k: int(v) for k, v in n_active.items()}
      if expected and expected != n_active:   # cannot happen unless the update is broken
        raise AssertionError(f"MST before the update of step {run.step}: active counts "
                             f"{n_active} != {expected} planned by the previous update")
      shapes = layer_shapes(state.params, state.sparsity)
      counts, scalars = plan_update(self, shapes, n_active, run.step, total)
      table = np.asarray([[counts[state_lib.layer_name(p)].n_prune,
                           counts[state_lib.layer_name(p)].n_grad,
                           counts[state_lib.layer_name(p)].n_rand] for p in paths], np.int32)
      own = state.sparsity[self.name]
      own = {"due": jax.device_put(np.asarray(True), own["due"].sharding),
             "counts": jax.device_put(table, own["counts"].sharding)}
      run.state = state.replace(sparsity={**state.sparsity, self.name: own})
      expected.clear()
      expected.update({k: c.n_after for k, c in counts.items()})
      run.write(run.step, scalars)

    def plot(run):
      records = metrics_lib.read_jsonl(run.writer.jsonl_path)
      steps, sparsity = metrics_lib.series(records, "mst/sparsity")
      plot_schedule(self, config, os.path.join(run.workdir, "mst_schedule.png"),
                    measured={"step": steps, "sparsity": sparsity})

    return [*super().hooks(config),
            hooks_lib.Hook(prepare, before_step=True, training=True,
                           due=lambda step: self.update_due(step, total),
                           name="MST topology update counts"),
            hooks_lib.Hook(plot, due=lambda step: step == total, name="MST schedule plot")]


# ---------------------------------------------------------------------------------------------
# The schedule plot.


def schedule_series(m: MST, total: int, steps: Sequence[int] | None = None
                    ) -> dict[str, np.ndarray]:
  """step, target sparsity, drop fraction and sparse-attention flag on a grid of steps."""
  if steps is None:
    steps = np.unique(np.linspace(0, max(total - 1, 0), min(total, 2000)).astype(int))
  return {
      "step": np.asarray(steps),
      "sparsity": np.asarray([target_sparsity(m, s, total) for s in steps]),
      "drop_fraction": np.asarray([drop_fraction(m, s, total) for s in steps]),
      "sparse_attention": np.asarray([attention_at(m, s, total, "causal") != "causal"
                                      for s in steps]),
  }


def plot_schedule(m: MST, config, png_path: str, *,
                  measured: Mapping[str, Sequence[float]] | None = None) -> str:
  """PNG of the Sparsity Variation schedule: target sparsity per phase, drop fraction, the
  sparse-attention window, and (optional) `measured` {'step': [...], 'sparsity': [...]}."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top  (no pyplot state)

  s = schedule_series(m, config.total_steps)
  fig = Figure(figsize=(8, 4))
  ax = fig.subplots()
  ax.plot(s["step"], s["sparsity"], "k-", lw=2, label="target sparsity")
  ax.plot(s["step"], s["drop_fraction"], "b--", lw=1, label="drop fraction $\\zeta_t$")
  if measured is not None and len(measured.get("step", ())):
    ax.plot(measured["step"], measured["sparsity"], "ro", ms=3, label="after each update")
  for (start, end), name, color in zip(phase_bounds(m, config.total_steps), PHASES,
                                       ("#fde0c5", "#f5b7b1", "#d5f5e3")):
    ax.axvspan(start, end, color=color, alpha=0.5, lw=0)
    ax.text((start + end) / 2, 1.02, name, ha="center", va="bottom", fontsize=8)
  a0, a1 = attention_window(m, config.total_steps)
  if a1 > a0:
    ax.axvspan(a0, a1, ymin=0, ymax=0.04, color="purple", alpha=0.6, lw=0,
               label=f"sparse attention ({m.sparse_attention}, "
                     f"l={config.model.attention_stride})")
  ax.set_ylim(0, 1.1)
  ax.set_xlabel("step"), ax.set_ylabel("fraction")
  ax.legend(fontsize=8, loc="center right")
  ax.set_title(f"MST Sparsity Variation ({m.schedule})")
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  return png_path


base.register_method("mst", MST())
