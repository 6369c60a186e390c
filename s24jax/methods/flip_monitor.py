"""A warning when the flip rate stays too high: the symptom of unstable 2:4 training.

Healthy sparse runs have a flip rate that rises early then decays (docs/algorithms.md, Flip rate); one
that stays above a threshold for several consecutive logs means the mask keeps churning
(too little masked decay, too high a learning rate). A single high log is common early in
training, so the warning waits for `patience` consecutive logs above the threshold.
"""
from __future__ import annotations

import math

from absl import logging


class FlipRateMonitor:
  """Counts consecutive logs whose global flip rate exceeds `threshold` (0: off).

  `update(step, flip_rate)` returns 1.0 while the streak is at least `patience` logs long
  (the `train/flip_rate_warning` metric) and 0.0 otherwise, and logs an absl warning when
  the streak reaches `patience` and again every `patience` logs while it lasts. A log with
  no flip rate (None or NaN: dense fine-tuning, no mask refresh in the interval) neither
  extends nor breaks the streak.
  """

  def __init__(self, threshold: float, patience: int):
    if patience < 1:
      raise ValueError(f"flip-rate warning patience must be >= 1, got {patience}")
    self.threshold = threshold
    self.patience = patience
    self.streak = 0

  def update(self, step: int, flip_rate: float | None) -> float:
    if not self.threshold:
      return 0.0
    if flip_rate is None or math.isnan(flip_rate):
      return float(self.streak >= self.patience)
    self.streak = self.streak + 1 if flip_rate > self.threshold else 0
    if self.streak >= self.patience and self.streak % self.patience == 0:
      logging.warning(
          "step %d: flip rate %.3g has been above sparsity.flip_rate_warn=%.3g for %d "
          "consecutive logs: the 2:4 mask keeps churning (unstable sparse training?); "
          "consider a larger masked decay lambda_W (sparsity.sr_ste.decay or "
          "sparsity.t_sr_ste.decay, or their decay_auto) or a lower learning rate.",
          step, flip_rate, self.threshold, self.streak)
    return float(self.streak >= self.patience)
