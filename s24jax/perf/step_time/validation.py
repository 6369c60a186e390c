"""How far the step-time model can be trusted, per device: its fit to the measured rows
(in-sample), each row predicted by the model fitted to the device's other rows
(leave-one-out: the error on a step it has not seen), and whether it orders the rows as the
measurements do (Kendall's tau, `kendall`).

The model is per device (s24jax/perf/roofline.py): its three constants are fitted to one GPU's
measured rows, with that GPU's cuSPARSELt table and peaks (calibration.RUNS).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from s24jax.perf import roofline
from s24jax.perf.step_time import calibration as cal


@dataclasses.dataclass(frozen=True)
class Ranking:
  """Pairs of rows ordered alike (concordant) or oppositely (discordant) by the measurement
  and the model; `tied`: pairs equal in either; `tau`: Kendall's tau-b (ties accounted);
  `widest_discordant`: the largest measured gap (slower / faster - 1) of a discordant pair,
  0 without one: pairs measured further apart were all ordered right."""
  concordant: int
  discordant: int
  tied: int
  tau: float
  widest_discordant: float


def kendall(measured: Sequence[float], model: Sequence[float]) -> Ranking:
  a, b = np.asarray(measured, float), np.asarray(model, float)
  upper = np.triu(np.ones((len(a), len(a)), bool), 1)          # each pair i < j once
  sa = np.sign(a[:, None] - a[None, :])[upper]
  sb = np.sign(b[:, None] - b[None, :])[upper]
  gap = (np.maximum(a[:, None], a[None, :]) / np.minimum(a[:, None], a[None, :]) - 1)[upper]
  concordant, discordant = int(np.sum(sa * sb > 0)), int(np.sum(sa * sb < 0))
  pairs, ties_a, ties_b = len(sa), int(np.sum(sa == 0)), int(np.sum(sb == 0))
  norm = np.sqrt(float(pairs - ties_a) * float(pairs - ties_b))
  tau = (concordant - discordant) / norm if norm else float("nan")
  return Ranking(concordant, discordant, int(np.sum((sa == 0) | (sb == 0))), float(tau),
                 float(np.max(gap[sa * sb < 0], initial=0.0)))


@dataclasses.dataclass(frozen=True)
class DeviceFit:
  """One device's model: its constants, table and rows; each row's time by the model
  (`model_s`) and by the model fitted without that row (`loo_s`, `loo_constants`)."""
  device: str
  runs: tuple[cal.Run, ...]
  limits: dict[str, tuple[float, float]]
  constants: roofline.Constants
  table: roofline.SparseTable
  rows: tuple[cal.Measured, ...]
  model_s: tuple[float, ...]
  loo_s: tuple[float, ...]
  loo_constants: tuple[roofline.Constants, ...]

  @property
  def measured_s(self) -> tuple[float, ...]:
    return tuple(m.row.seconds for m in self.rows)

  def errors(self, loo: bool = False) -> list[float]:
    """model / measured - 1 per row (leave-one-out's with loo)."""
    model = self.loo_s if loo else self.model_s
    return [p / m - 1 for p, m in zip(model, self.measured_s)]

  def summary(self, loo: bool = False) -> dict[str, Any]:
    err = np.abs(self.errors(loo))
    rank = kendall(self.measured_s, self.loo_s if loo else self.model_s)
    return {"median_abs_error": float(np.median(err)), "max_abs_error": float(np.max(err)),
            "kendall_tau": rank.tau, "concordant_pairs": rank.concordant,
            "discordant_pairs": rank.discordant, "tied_pairs": rank.tied,
            "widest_discordant_gap": rank.widest_discordant}

  def step_seconds(self, kernels) -> float:
    return roofline.step_seconds(kernels, self.constants, self.table)


def fit_device(runs: Sequence[cal.Run], rows: Sequence[cal.Measured],
               table: roofline.SparseTable | None = None) -> DeviceFit:
  """The device's model fitted to all its rows, and refitted once per row without it (a
  device with one row has no leave-one-out prediction: NaN); `table`: the runs' measured
  cuSPARSELt GEMMs unless given."""
  run = runs[0]
  limits = roofline.bounds(run.peak_flops_per_s, run.peak_bytes_per_s)
  if table is None:
    table = roofline.SparseTable(tuple(g for r in runs for g in cal.sparse_table(r.path).gemms))
  plain = [m.row for m in rows]
  c = roofline.fit(plain, table, limits=limits)
  loo_s, loo_c = [], []
  for i, row in enumerate(plain):
    others = plain[:i] + plain[i + 1:]
    ci = roofline.fit(others, table, limits=limits) if others else None
    loo_c.append(ci)
    loo_s.append(roofline.step_seconds(row.kernels, ci, table) if ci else float("nan"))
  return DeviceFit(run.device, tuple(runs), limits, c, table, tuple(rows),
                   tuple(roofline.step_seconds(r.kernels, c, table) for r in plain),
                   tuple(loo_s), tuple(loo_c))


def fit_all(calibration: dict[str, dict[str, Any]], source: str = cal.CALIBRATION.name,
            runs=cal.RUNS) -> dict[str, DeviceFit]:
  """device -> its model (the order of `runs`)."""
  rows = cal.calibration_rows(calibration, source, runs)
  devices = list(dict.fromkeys(r.device for r in runs))
  return {d: fit_device([r for r in runs if r.device == d],
                        [m for m in rows if m.run.device == d]) for d in devices}


def constants_json(c: roofline.Constants) -> dict[str, float]:
  return {"flops_per_s": c.flops_per_s, "bytes_per_s": c.bytes_per_s, "launch_s": c.launch_s,
          "fp8_speedup": roofline.FP8_SPEEDUP}


def device_json(fit: DeviceFit) -> dict[str, Any]:
  """The device's constants, each row's measured, in-sample and leave-one-out times and
  errors, and both error summaries (with the ranking)."""
  rows = []
  for m, model, loo, err, loo_err in zip(fit.rows, fit.model_s, fit.loo_s, fit.errors(),
                                         fit.errors(loo=True)):
    rows.append({"row": m.row.name, "run": m.run.folder, "measured_ms": 1e3 * m.row.seconds,
                 "measured_ms_each": list(m.times_ms), "model_ms": 1e3 * model, "error": err,
                 # None: a device with one row has no leave-one-out prediction
                 "loo_model_ms": None if np.isnan(loo) else 1e3 * loo,
                 "loo_error": None if np.isnan(loo_err) else loo_err})
  def finite(summary):   # NaN (one row: nothing left out) as null
    return {k: None if isinstance(v, float) and np.isnan(v) else v for k, v in summary.items()}
  return {"runs": [r.folder for r in fit.runs], "constants": constants_json(fit.constants),
          "bounds": {k: list(v) for k, v in fit.limits.items()}, "rows": rows,
          "in_sample": finite(fit.summary()), "leave_one_out": finite(fit.summary(loo=True))}
