"""MST's schedules: step -> phase, target sparsity, drop fraction, attention pattern (host-side
floats; docs/algorithms.md, MST). `m` is the method (its fields are the schedule's settings)."""
from __future__ import annotations

import math

import numpy as np

PHASES = ("warm-up", "ultra-sparsification", "restoration")
SCHEDULES = ("steps", "cosine_ramps")


def phase_bounds(m, total_steps: int) -> list[tuple[int, int]]:
  """[start, end) steps of the warm-up, ultra-sparsification and restoration phases."""
  ends = np.rint(np.cumsum(tuple(m.phase_fractions)) * total_steps).astype(int)
  ends[-1] = total_steps
  starts = np.concatenate([[0], ends[:-1]])
  return [(int(s), int(e)) for s, e in zip(starts, ends)]


def phase_at(m, step: int, total_steps: int) -> int:
  """Index into PHASES of the phase `step` is in (steps past the end: the last phase)."""
  for i, (_, end) in enumerate(phase_bounds(m, total_steps)):
    if step < end:
      return i
  return len(PHASES) - 1


def _cosine_ramp(u: float) -> float:
  """0 at u <= 0, 1 at u >= 1, half a cosine in between (smooth at both ends)."""
  u = min(max(u, 0.0), 1.0)
  return 0.5 * (1.0 - math.cos(math.pi * u))


def target_sparsity(m, step: int, total_steps: int) -> float:
  """The global target sparsity at `step` (Sparsity Variation).

  'steps' (the reference's piecewise-constant schedule): the level of the phase `step` is in
  (warm-up: target_sparsity, ultra: ultra_sparsity, restoration: final_sparsity).
  'cosine_ramps': phase i moves from the level the previous phase ended at to its own level
  (before warm-up: initial_sparsity) by a cosine ramp over its first `ramp_fraction`, then
  holds it.
  """
  levels = (m.initial_sparsity, m.target_sparsity, m.ultra_sparsity,
            m.final_sparsity)
  i = phase_at(m, step, total_steps)
  if m.schedule == "steps":
    return float(levels[i + 1])
  start, end = phase_bounds(m, total_steps)[i]
  ramp = m.ramp_fraction * (end - start)
  u = (step - start) / ramp if ramp > 0 else 1.0
  return float(levels[i] + (levels[i + 1] - levels[i]) * _cosine_ramp(u))


def drop_fraction(m, step: int, total_steps: int) -> float:
  """zeta_t = zeta/2 (1 + cos(pi (t - start) / (end - start))): over the whole run (start 0,
  end total_steps), or over each phase with `anneal_per_phase` (the reference's stepwise
  annealing)."""
  start, end = 0, total_steps
  if m.anneal_per_phase:
    start, end = phase_bounds(m, total_steps)[phase_at(m, step, total_steps)]
  if end <= start:
    return 0.0
  return m.drop_fraction / 2 * (1 + math.cos(math.pi * (step - start) / (end - start)))


def attention_window(m, total_steps: int) -> tuple[int, int]:
  """[start, end) steps of the sparse-attention window (empty if it is 'causal')."""
  m, total = m, total_steps
  if m.sparse_attention == "causal":
    return (0, 0)
  return (int(round(m.sparse_attention_start * total)), int(round(m.sparse_attention_end * total)))


def attention_at(m, step: int, total_steps: int, outside: str) -> str:
  """The attention pattern of `step`: sparse_attention inside the window, else `outside`
  (model.attention): Hybrid Sparse Attention."""
  start, end = attention_window(m, total_steps)
  return m.sparse_attention if start <= step < end else outside
