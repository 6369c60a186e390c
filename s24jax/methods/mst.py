"""Mixed Sparsity Training (Hu, Li, Huang): dynamic sparse training with Sparsity Variation.

docs/algorithms.md, MST. The linear layers matching sparsity.sparse_layers (the experiment:
attn qkv/out and mlp fc/proj; embeddings and the tied head stay dense) trains with an unstructured mask kept in the train state
(`sparsity[layer]['mask']`, the 'mst' projection: forward mask * W, dense gradient backward).

How the pieces fit:
- `train_step` feeds only the active entries' gradients to the optimizer and keeps the pruned
  weights at exactly 0, so between updates MST is ordinary sparse training.
- Every `mst.update_every` steps (Delta; also at step 0) the loop calls `topology_update`
  *before* the step's optimizer update, on the step's batch: one extra forward/backward gives
  the dense gradient dL/dW~, then every layer
    1. drops its `n_drop` smallest-|W| active weights,
    2. regrows `n_grow` weights among the positions that were inactive *before* this update
       (a weight dropped now is not regrown in the same update): a share r/(r+1) where
       |dL/dW~| is largest, the rest uniformly at random (Mixed-Growing),
    3. zeroes the dropped and the regrown weights (regrowth starts at 0) and resets their
       optimizer moments (every params-shaped leaf of the optimizer state, e.g. Adam's mu, nu).
  With n_active active weights and the layer's target count k (from the sparsity schedule and
  the layer densities), swap = floor(zeta_t * n_active), capped so that every dropped weight
  was active and every regrown one was inactive, and
    n_drop = swap + max(n_active - k, 0),   n_grow = swap + max(k - n_active, 0),
  so after the update the layer has exactly k active weights: when the schedule raises the
  sparsity the update prunes more than it grows, when it lowers it the update grows more.
- Ties are broken towards the lower flat index (drop: smallest |W| first; grow: largest
  |grad| first), so the update is a deterministic function of (state, batch, step rng).
- zeta_t = zeta/2 (1 + cos(pi t / T)): cosine-annealed drop fraction over the run, or over
  each sparsity phase when `mst.anneal_per_phase` (the paper's piecewise cosine annealing).
- Layer densities are Erdos-Renyi: density_l proportional to (n_in + n_out) / (n_in n_out),
  scaled so the total matches the global target, capped at 1 (the excess is redistributed
  over the uncapped layers).
- Sparsity Variation: a three-phase target sparsity (warm-up from dense, ultra-sparsification,
  restoration toward dense), `target_sparsity(...)`; Hybrid Sparse Attention: a sparse
  attention pattern during a window of training, `attention_at(...)`.

The random choice of step t uses fold_in(fold_in(state.rng, t), _RNG_TAG): a run resumed from a
checkpoint makes exactly the updates an uninterrupted one makes.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, ClassVar, Mapping, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from s24jax import attention_masks
from s24jax import hooks as hooks_lib
from s24jax import losses
from s24jax import metrics as metrics_lib
from s24jax import state as state_lib
from s24jax.methods import base
from s24jax.state import TrainState

DISTRIBUTIONS = ("erdos_renyi", "uniform")
PHASES = ("warm-up", "ultra-sparsification", "restoration")
_RNG_TAG = 0x6D7374   # 'mst': decorrelates the growth rng from other uses of the step rng

Path = tuple[str, ...]


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

  Phase i moves from the level the previous phase ended at to its own level (warm-up:
  target_sparsity, ultra: ultra_sparsity, restoration: final_sparsity; before warm-up:
  initial_sparsity) by a cosine ramp over its first `ramp_fraction`, then holds the level.
  """
  levels = (mst_cfg.initial_sparsity, mst_cfg.target_sparsity, mst_cfg.ultra_sparsity,
            mst_cfg.final_sparsity)
  i = phase_at(mst_cfg, step, total_steps)
  start, end = phase_bounds(mst_cfg, total_steps)[i]
  ramp = mst_cfg.ramp_fraction * (end - start)
  u = (step - start) / ramp if ramp > 0 else 1.0
  return float(levels[i] + (levels[i + 1] - levels[i]) * _cosine_ramp(u))


def drop_fraction(mst_cfg, step: int, total_steps: int) -> float:
  """zeta_t = zeta/2 (1 + cos(pi t / T)), over the run or (anneal_per_phase) over each phase."""
  t, length = step, total_steps
  if mst_cfg.anneal_per_phase:
    start, end = phase_bounds(mst_cfg, total_steps)[phase_at(mst_cfg, step, total_steps)]
    t, length = step - start, end - start
  u = min(max(t / length, 0.0), 1.0) if length > 0 else 1.0
  return float(mst_cfg.drop_fraction) * 0.5 * (1.0 + math.cos(math.pi * u))


def grow_gradient_share(mst_cfg) -> float:
  """r / (r + 1): the share of regrown weights chosen by gradient magnitude."""
  r = float(mst_cfg.grow_ratio)
  return 1.0 if math.isinf(r) else r / (r + 1.0)


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
# Layer densities.


def erdos_renyi_densities(shapes: Mapping[Any, tuple[int, int]],
                          density: float) -> dict[Any, float]:
  """Per-layer densities, ER: density_l = min(1, eps (n_in + n_out) / (n_in n_out)).

  `shapes` maps a layer to its kernel shape (out, in); eps is chosen so that
  sum_l density_l * size_l = density * sum_l size_l. Layers whose ER density would exceed 1
  are made dense and eps is solved again over the others (their share is redistributed),
  until no layer exceeds 1.
  """
  if not 0.0 <= density <= 1.0:
    raise ValueError(f"density must be in [0, 1], got {density}")
  size = {k: int(o) * int(i) for k, (o, i) in shapes.items()}
  raw = {k: (int(o) + int(i)) / (int(o) * int(i)) for k, (o, i) in shapes.items()}
  budget = density * sum(size.values())
  dense: set = set()
  while True:
    rest = [k for k in shapes if k not in dense]
    if not rest:
      break
    eps = (budget - sum(size[k] for k in dense)) / sum(raw[k] * size[k] for k in rest)
    over = {k for k in rest if eps * raw[k] > 1.0}
    if not over:
      break
    dense |= over
  return {k: 1.0 if k in dense else max(0.0, eps * raw[k]) for k in shapes}


def layer_densities(shapes: Mapping[Any, tuple[int, int]], density: float,
                    distribution: str = "erdos_renyi") -> dict[Any, float]:
  """Per-layer densities for a global `density` under `distribution` (DISTRIBUTIONS)."""
  if distribution == "erdos_renyi":
    return erdos_renyi_densities(shapes, density)
  if distribution == "uniform":
    return {k: float(density) for k in shapes}
  raise ValueError(f"unknown mst.distribution {distribution!r}; valid: {', '.join(DISTRIBUTIONS)}")


def target_counts(shapes: Mapping[Any, tuple[int, int]], sparsity: float,
                  distribution: str = "erdos_renyi") -> dict[Any, int]:
  """Active-weight count of every layer at global `sparsity`: round(density_l * size_l)."""
  dens = layer_densities(shapes, 1.0 - sparsity, distribution)
  out = {}
  for k, (o, i) in shapes.items():
    n = int(o) * int(i)
    out[k] = min(n, max(0, int(math.floor(dens[k] * n + 0.5))))
  return out


def kernel_shapes(params: Any, sparsity: Any) -> dict[Path, tuple[int, int]]:
  """(out, in) kernel shape of every layer with a stored mask, keyed by module path."""
  return {p: tuple(state_lib.get_path(params, p)["kernel"].shape)
          for p in state_lib.sparse_layer_paths(sparsity)}


# ---------------------------------------------------------------------------------------------
# The topology update of one layer (pure jnp; counts may be traced).


def swap_counts(n_active, target, size: int, drop_frac, grad_share):
  """(n_drop, n_grow_gradient, n_grow_random) for one layer (see the module docstring).

  All int32; n_active, target, drop_frac, grad_share may be traced scalars.
  """
  n_active = jnp.asarray(n_active, jnp.int32)
  target = jnp.clip(jnp.asarray(target, jnp.int32), 0, size)
  swap = jnp.floor(jnp.asarray(drop_frac, jnp.float32) * n_active.astype(jnp.float32))
  room = jnp.minimum(jnp.minimum(n_active, target), size - jnp.maximum(n_active, target))
  swap = jnp.clip(swap.astype(jnp.int32), 0, room)
  n_drop = swap + jnp.maximum(n_active - target, 0)
  n_grow = swap + jnp.maximum(target - n_active, 0)
  n_grad = jnp.floor(jnp.asarray(grad_share, jnp.float32) * n_grow.astype(jnp.float32) + 0.5)
  n_grad = jnp.minimum(n_grad.astype(jnp.int32), n_grow)
  return n_drop, n_grad, n_grow - n_grad


def _ranks(key: jax.Array) -> jax.Array:
  """Rank of every entry of a 1-D key in ascending order; ties: the lower index first."""
  order = jnp.argsort(key, stable=True)
  return jnp.zeros(key.shape, jnp.int32).at[order].set(jnp.arange(key.size, dtype=jnp.int32))


def update_layer_mask(w: jax.Array, mask: jax.Array, grad: jax.Array, target, drop_frac,
                      grad_share, key: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Drop-and-grow of one layer. Returns the new mask and the bool masks of what changed.

  w, mask, grad: (out, in). Drops the n_drop smallest |w| among the active entries; grows
  n_grad entries with the largest |grad| and n_rand uniformly random ones among the entries
  inactive before the update (swap_counts gives the counts). The info dict has 'dropped',
  'grown_gradient', 'grown_random' (bool, like mask).
  """
  shape = mask.shape
  m = mask.reshape(-1)                                                       # (D,)
  size = m.size
  n_drop, n_grad, n_rand = swap_counts(jnp.sum(m, dtype=jnp.int32), target, size,
                                       drop_frac, grad_share)
  a = jnp.abs(w.reshape(-1).astype(jnp.float32))                             # (D,)
  dropped = m & (_ranks(jnp.where(m, a, jnp.inf)) < n_drop)
  g = jnp.abs(grad.reshape(-1).astype(jnp.float32))                          # (D,)
  grown_gradient = ~m & (_ranks(jnp.where(m, jnp.inf, -g)) < n_grad)
  candidates = ~m & ~grown_gradient
  u = jax.random.uniform(key, (size,))                                       # (D,) in [0, 1)
  grown_random = candidates & (_ranks(jnp.where(candidates, u, 2.0)) < n_rand)
  new = (m & ~dropped) | grown_gradient | grown_random
  info = {"dropped": dropped, "grown_gradient": grown_gradient, "grown_random": grown_random}
  return new.reshape(shape), {k: v.reshape(shape) for k, v in info.items()}


# ---------------------------------------------------------------------------------------------
# The topology update of the whole train state (jitted).


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


def dense_gradients(state: TrainState, batch, model) -> Any:
  """dL/dW of the mean loss on `batch`; through the 'mst' projection the sparse kernels' gradient
  is the dense dL/dW~ (also at the pruned entries)."""

  def loss_fn(params):
    variables = {"params": params, "sparsity": state.sparsity}
    logits = model.apply(variables, batch["inputs"])                          # (B, T, V)
    return losses.cross_entropy_sum(logits, batch["targets"]) / batch["targets"].size

  return jax.grad(loss_fn)(state.params)


def update_rng(state: TrainState) -> jax.Array:
  return jax.random.fold_in(jax.random.fold_in(state.rng, state.step), _RNG_TAG)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("state",))
def topology_update(state: TrainState, batch, targets: Mapping[str, jax.Array],
                    drop_frac: jax.Array, grad_share: jax.Array, *,
                    model) -> tuple[TrainState, dict[str, jax.Array]]:
  """One MST drop-and-grow of every masked layer (see the module docstring).

  `targets` maps layer names ('h_0/attn/qkv') to their active-weight count after the update
  (int32 scalars: a new count does not recompile). Returns the new state and metrics:
  'mst/active/<layer>' (counts after), 'mst/changed_fraction' (entries whose mask changed /
  all masked entries), and the total dropped / gradient-grown / random-grown counts.
  """
  grads = dense_gradients(state, batch, model)
  key = update_rng(state)
  params = flax.core.unfreeze(jax.tree.map(lambda x: x, state.params))
  reset = jax.tree.map(lambda _: jnp.zeros((), bool), params)
  new_masks, metrics = {}, {}
  totals = {"dropped": 0, "grown_gradient": 0, "grown_random": 0}
  changed_sum, size_sum = 0, 0
  for i, path in enumerate(state_lib.sparse_layer_paths(state.sparsity)):
    name = state_lib.layer_name(path)
    layer = state_lib.get_path(params, path)
    old = state_lib.get_path(state.sparsity, path)["mask"]
    new, info = update_layer_mask(layer["kernel"], old, state_lib.get_path(grads, path)["kernel"],
                                  targets[name], drop_frac, grad_share,
                                  jax.random.fold_in(key, i))
    changed = new != old
    # Dropped weights become 0 (pruned) and regrown ones start at 0: keep W only where it
    # was active before and stays active.
    layer["kernel"] = jnp.where(new & old, layer["kernel"], 0)
    state_lib.get_path(reset, path)["kernel"] = changed
    new_masks[path] = new
    metrics[f"mst/active/{name}"] = jnp.sum(new, dtype=jnp.int32)
    for k in totals:
      totals[k] = totals[k] + jnp.sum(info[k], dtype=jnp.int32)
    changed_sum = changed_sum + jnp.sum(changed, dtype=jnp.int32)
    size_sum += new.size
  metrics.update({f"mst/{k}": v for k, v in totals.items()})
  metrics["mst/changed_fraction"] = changed_sum / max(size_sum, 1)
  opt_state = reset_params_shaped(state.opt_state, params, reset)
  sparsity = state_lib.with_masks(state.sparsity, new_masks)
  return state.replace(params=params, opt_state=opt_state, sparsity=sparsity), metrics


# ---------------------------------------------------------------------------------------------
# The projection: mask from the state, dense gradient.


@jax.custom_vjp
def masked_dense_grad(w: jax.Array, mask: jax.Array) -> jax.Array:
  """Forward W~ = mask * W (any unstructured bool mask); backward dL/dW := dL/dW~, dense.

  The dense gradient reaches the pruned entries too: MST grows connections where |dL/dW~|
  is largest. `MST.gradients` then keeps only the active entries' gradients for the
  optimizer (so pruned weights stay exactly 0 under Adam); the topology update reads the
  dense one.
  """
  return jnp.where(mask, w, 0)


def _masked_dense_grad_fwd(w, mask):
  return masked_dense_grad(w, mask), None


def _masked_dense_grad_bwd(_, g):
  return g, None   # the mask is a bool input: no cotangent


masked_dense_grad.defvjp(_masked_dense_grad_fwd, _masked_dense_grad_bwd)


# ---------------------------------------------------------------------------------------------
# The method.


@dataclasses.dataclass(frozen=True)
class MST(base.Method):
  """Its fields are the config block `config.sparsity.mst` (docs/algorithms.md, MST)."""
  structured_24: ClassVar[bool] = False   # unstructured masks: the 'xla' backend only
  update_every: int = 100         # Delta: steps between topology updates
  drop_fraction: float = 0.3      # zeta: drop fraction, cosine-annealed zeta/2 (1 + cos(pi t/T))
  anneal_per_phase: bool = False  # restart the cosine in every sparsity phase (piecewise)
  grow_ratio: float = 3.0         # r: a share r/(r+1) of regrowth by |gradient|, the rest random
  distribution: str = "erdos_renyi"  # layer densities: 'erdos_renyi' or 'uniform'
  # Sparsity Variation: three phases (fractions of total_steps); in each phase the target
  # sparsity moves by a cosine ramp over the first `ramp_fraction` of the phase to the phase's
  # level, then holds it: warm-up -> target, ultra-sparsification -> ultra, restoration -> final.
  initial_sparsity: float = 0.0   # dense start
  target_sparsity: float = 0.8
  ultra_sparsity: float = 0.9
  final_sparsity: float = 0.7     # restoration: back toward dense
  phase_fractions: tuple[float, ...] = (0.25, 0.5, 0.25)
  ramp_fraction: float = 0.5
  # Hybrid Sparse Attention: this pattern during [start, end) (fractions of total_steps),
  # model.attention outside; 'causal' turns it off.
  sparse_attention: str = "causal"
  sparse_attention_start: float = 0.25
  sparse_attention_end: float = 0.75

  def __post_init__(self):
    base.check_positive_int("sparsity.mst.update_every", self.update_every)
    if self.distribution not in DISTRIBUTIONS:
      raise ValueError(f"unknown sparsity.mst.distribution {self.distribution!r}; valid: "
                       f"{', '.join(DISTRIBUTIONS)}")
    if not 0.0 <= self.drop_fraction <= 1.0:
      raise ValueError(f"sparsity.mst.drop_fraction (zeta) must be in [0, 1], got "
                       f"{self.drop_fraction}")
    if self.grow_ratio < 0:
      raise ValueError(f"sparsity.mst.grow_ratio (r) must be >= 0, got {self.grow_ratio}")
    for name in ("initial_sparsity", "target_sparsity", "ultra_sparsity", "final_sparsity"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"sparsity.mst.{name} must be in [0, 1], got {getattr(self, name)}")
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
    if config.sparsity.backend != "xla":   # fast backends assume 2:4; these masks are not
      raise ValueError(f"sparsity.projection={self.name!r} (unstructured masks) needs "
                       f"sparsity.backend='xla', got {config.sparsity.backend!r}")
    attention_masks.check_pattern(self.sparse_attention, config.model.attention_stride)
    return self

  # -- the step: mask in the state, dense gradient, pruned weights stay 0 ----------------------

  def init_layer(self, kernel):
    # Training starts dense (the warm-up phase prunes from there).
    return {"mask": jnp.ones(kernel.shape, bool)}

  def mask(self, kernel, layer):
    return layer["mask"] if "mask" in layer else jnp.ones(kernel.shape, bool)

  def project(self, kernel, layer):
    return masked_dense_grad(kernel, layer["mask"])

  def gradients(self, grads, sparsity):
    # Only active weights learn; the dense gradient reaches pruned ones only in the update.
    return state_lib.mask_sparse_kernels(grads, sparsity)

  def after_update(self, params, sparsity, step):
    del step   # the mask changes only in topology updates (between steps)
    return state_lib.mask_sparse_kernels(params, sparsity), sparsity, {}

  # -- the loop: topology updates, attention windows, FLOPs ------------------------------------

  def model_at(self, step, model_cfg, config):
    model_cfg = super().model_at(step, model_cfg, config)
    pattern = attention_at(self, step, config.total_steps, config.model.attention)
    return dataclasses.replace(model_cfg, attention=pattern)

  def update_due(self, step: int) -> bool:
    return step % int(self.update_every) == 0

  def targets(self, shapes, step: int, total_steps: int) -> dict[str, int]:
    """Active-weight count per layer name after the update at `step`."""
    counts = target_counts(shapes, target_sparsity(self, step, total_steps), self.distribution)
    return {state_lib.layer_name(p) if isinstance(p, tuple) else p: n
            for p, n in counts.items()}

  def flop_profile(self, step, shapes, config):
    if not self.update_due(step):
      return None, False
    return self.targets(shapes, step, config.total_steps), True

  def hooks(self, config):
    total = config.total_steps

    def update(run):
      if run.model_cfg.sparsity.method != self:   # dense fine-tuning: no more updates
        return
      run.state, scalars = self.update(run.state, run.batch, run.step, total, model=run.model)
      run.write(run.step, scalars)

    def plot(run):
      records = metrics_lib.read_jsonl(run.writer.jsonl_path)
      steps, sparsity = metrics_lib.series(records, "mst/sparsity")
      plot_schedule(self, config, os.path.join(run.workdir, "mst_schedule.png"),
                    measured={"step": steps, "sparsity": sparsity})

    return [*super().hooks(config),
            hooks_lib.Hook(update, before_step=True, training=True, due=self.update_due,
                           name="MST topology update"),
            hooks_lib.Hook(plot, due=lambda step: step == total, name="MST schedule plot")]

  def update(self, state: TrainState, batch, step: int, total_steps: int, *,
             model) -> tuple[TrainState, dict[str, float]]:
    """Runs the topology update of `step`; returns the new state and host scalars."""
    shapes = kernel_shapes(state.params, state.sparsity)
    if not shapes:
      raise ValueError(f"sparsity.projection={self.name!r} but no linear layer matches "
                       "sparsity.sparse_layers")
    targets = self.targets(shapes, step, total_steps)
    zeta = drop_fraction(self, step, total_steps)
    state, metrics = topology_update(
        state, batch, {k: jnp.asarray(v, jnp.int32) for k, v in targets.items()},
        jnp.asarray(zeta, jnp.float32), jnp.asarray(grow_gradient_share(self), jnp.float32),
        model=model)
    host = jax.device_get(metrics)
    active = {k[len("mst/active/"):]: int(v) for k, v in host.items()
              if k.startswith("mst/active/")}
    if active != targets:   # cannot happen unless the update is broken: fail loudly
      raise AssertionError(f"MST update at step {step}: active counts {active} != targets "
                           f"{targets}")
    size = sum(o * i for o, i in shapes.values())
    scalars = {k: float(v) for k, v in host.items() if not k.startswith("mst/active/")}
    scalars.update({"mst/target_sparsity": target_sparsity(self, step, total_steps),
                    "mst/sparsity": 1.0 - sum(active.values()) / size,
                    "mst/drop_fraction": zeta})
    return state, scalars


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
    ax.plot(measured["step"], measured["sparsity"], "ro", ms=3, label="measured (after update)")
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
  ax.set_title("MST Sparsity Variation")
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  return png_path


base.register_method("mst", MST())
