"""MST's update counts (host side, float64): per layer, how many weights an update drops and
grows by gradient and at random, and the plan of a whole run (docs/algorithms.md, MST,
"Counts"). The counts follow from the schedule and the layer shapes alone, so the plan is
computed once and the device reads it (`Plan.table`)."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping

import numpy as np

from s24jax.methods.mst import densities
from s24jax.methods.mst import schedule
from s24jax.methods.mst.densities import Shapes

# After the first update, a target within this distance of the measured global sparsity
# keeps every layer's sparsity (no forced pruning or growth), as the reference does.
SAME_TARGET_TOL = 1e-4


def grow_split(n_grow: int, grow_ratio: float) -> tuple[int, int]:
  """(by gradient, at random) = (int(n_grow (r / (r + 1))), the rest): truncated, as the
  reference does (n_grow = 2, r = 3 gives 1 and 1). r = inf: all by gradient."""
  r = float(grow_ratio)
  if math.isinf(r):
    return n_grow, 0
  n_grad = int(n_grow * (r / (r + 1)))
  return n_grad, n_grow - n_grad


@dataclasses.dataclass(frozen=True)
class LayerCounts:
  """One layer's update: drop n_prune, grow n_grad by gradient and n_rand at random."""
  n_prune: int
  n_grad: int
  n_rand: int
  n_before: int
  n_after: int


def layer_counts(m, n_total: int, n_ones: int, zeta_t: float, s_before: float,
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


def initial_counts(m, shapes: Shapes, total_steps: int) -> dict[str, int]:
  """Active weights per layer at step 0 (init: N - int(S_l N) per layer, or dense)."""
  level = schedule.target_sparsity(m, 0, total_steps)
  if m.init == "dense" or level == 0:
    return {k: int(o) * int(i) for k, (o, i) in shapes.items()}
  s = densities.layer_sparsities(shapes, level, m.distribution)
  return {k: int(o) * int(i) - int(s[k] * (int(o) * int(i))) for k, (o, i) in shapes.items()}


def plan_update(m, shapes: Shapes, n_active: Mapping[str, int], step: int,
                total_steps: int) -> tuple[dict[str, LayerCounts], dict[str, float]]:
  """The counts of the update at `step` from the layers' active counts before it, with the
  scheduler's bookkeeping (reconstructed from the counts, so a resumed run plans the same):
  per-layer records S_l are the nominal floats of the initial level until the first update
  (step Delta), then 1 - n_active / N. Returns ({layer: LayerCounts}, host scalars)."""
  sizes = {k: int(o) * int(i) for k, (o, i) in shapes.items()}
  target = schedule.target_sparsity(m, step, total_steps)
  zeta_t = schedule.drop_fraction(m, step, total_steps)
  updated_before = step > m.update_every
  if updated_before:
    s_now = {k: 1 - n_active[k] / sizes[k] for k in shapes}
    measured = 1 - sum(n_active[k] for k in shapes) / sum(sizes.values())
  elif m.init == "dense" or schedule.target_sparsity(m, 0, total_steps) == 0:
    s_now = {k: 0.0 for k in shapes}
    measured = 0.0
  else:
    measured = schedule.target_sparsity(m, 0, total_steps)
    s_now = densities.layer_sparsities(shapes, measured, m.distribution)
  if updated_before and abs(target - measured) < SAME_TARGET_TOL:
    s_next = dict(s_now)
  else:
    s_next = densities.layer_sparsities(shapes, target, m.distribution)
  counts = {k: layer_counts(m, sizes[k], int(n_active[k]), zeta_t, s_now[k], s_next[k])
            for k in shapes}
  after = sum(c.n_after for c in counts.values())
  scalars = {"mst/target_sparsity": target, "mst/drop_fraction": zeta_t,
             "mst/sparsity": 1 - after / sum(sizes.values()),
             "mst/n_prune": float(sum(c.n_prune for c in counts.values())),
             "mst/n_grow": float(sum(c.n_grad + c.n_rand for c in counts.values()))}
  return counts, scalars


@dataclasses.dataclass(frozen=True)
class Plan:
  """Every topology update of a run, computed before it starts: the counts follow from the
  schedule and the layer shapes alone (each update plans the active counts the next one
  starts from), so nothing is measured on the host during the run."""
  first: dict[str, int]                       # active weights per layer at step 0
  steps: tuple[int, ...]                      # update steps Delta, 2 Delta, ... < total_steps
  counts: tuple[dict[str, LayerCounts], ...]  # per update: per layer
  scalars: tuple[dict[str, float], ...]       # per update: what the run logs ('mst/...')

  def table(self, names) -> np.ndarray:
    """(max(updates, 1), layers, 3) int32: (n_prune, n_grad, n_rand) per update and layer,
    layers in the order of `names` (the device update's order); zeros if no update."""
    rows = [[[c[k].n_prune, c[k].n_grad, c[k].n_rand] for k in names] for c in self.counts]
    return np.asarray(rows or [[[0, 0, 0]] * len(names)], np.int32).reshape(-1, len(names), 3)

  def active_after(self) -> dict[int, dict[str, int]]:
    """{update step: active weights per layer after it}."""
    return {step: {k: c.n_after for k, c in counts.items()}
            for step, counts in zip(self.steps, self.counts)}


@functools.lru_cache(maxsize=16)
def plan(m, shapes: tuple[tuple[str, tuple[int, int]], ...], total_steps: int) -> Plan:
  """The plan of a whole run of method `m` over layers `shapes` (name, (out, in)), in the
  reference's order."""
  shapes_d = dict(shapes)
  n = initial_counts(m, shapes_d, total_steps)
  first, steps, all_counts, all_scalars = dict(n), [], [], []
  for step in range(m.update_every, total_steps, m.update_every):
    counts, scalars = plan_update(m, shapes_d, n, step, total_steps)
    n = {k: c.n_after for k, c in counts.items()}
    steps.append(step)
    all_counts.append(counts)
    all_scalars.append(scalars)
  return Plan(first, tuple(steps), tuple(all_counts), tuple(all_scalars))
