"""Tests for s24jax/methods/flip_monitor.py (the flip-rate warning) and the chore through which the
base method runs it (s24jax/methods/base.py, `Method.chores`).

References: the streak of consecutive high logs counted by hand for a fixed sequence of
flip rates; the chore driven with StepInfo values and a recording context, its due steps and
writes compared with the loop's schedule stated directly (after each logged step).
"""
from __future__ import annotations

import types

import pytest

from s24jax.methods import flip_monitor
from s24jax.methods import base
from s24jax.methods import registry
from s24jax.step_info import StepInfo

from tiny import tiny_config


def test_flip_rate_warning_fires_after_patience_not_before(monkeypatch):
  warnings = []
  monkeypatch.setattr(flip_monitor.logging, "warning", lambda *a: warnings.append(a))
  mon = flip_monitor.FlipRateMonitor(threshold=0.1, patience=3)
  seq = [0.2, 0.2, 0.05, 0.2, 0.2, None, float("nan"), 0.2, 0.2, 0.2, 0.2, 0.2, 0.01]
  flags = [mon.update(i, r) for i, r in enumerate(seq)]
  # streak: 1 2 0 1 2 (2) (2) 3 4 5 6 7 0 -> fires from the 3rd consecutive high log on.
  assert flags == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0]
  assert [w[1] for w in warnings] == [7, 10]            # at streak 3 and again at 6
  off = flip_monitor.FlipRateMonitor(threshold=0.0, patience=1)
  assert [off.update(i, 1.0) for i in range(3)] == [0, 0, 0]


def _facts(warn, patience, steps=12):
  return base.RunFacts.from_config(tiny_config("ste", steps=steps, overrides={
      "sparsity.flip_rate_warn": warn, "sparsity.flip_rate_warn_patience": patience}))


def test_the_base_method_runs_the_warning_after_each_logged_step(monkeypatch):
  """One chore, due after exactly the steps the loop logs (info.log), reading the log's
  train/flip_rate and writing train/flip_rate_warning at the steps done; nothing written in
  the dense phase; no chore when the warning is off or the method is dense."""
  monkeypatch.setattr(flip_monitor.logging, "warning", lambda *a: None)
  facts = _facts(0.1, 2)
  [chore] = registry.get_method("ste").chores(facts)
  assert not chore.before_step
  logged = {2, 5, 8, 11}
  for step in range(12):
    for log in (False, True):
      assert chore.is_due(StepInfo(step=step, log=log), 12) == log
  written = []
  ctx = types.SimpleNamespace(sparse_phase=True, last_log={},
                              write=lambda step, scalars: written.append((step, scalars)))
  rates = {2: 0.2, 5: 0.3, 8: 0.05, 11: 0.5}
  for step in sorted(logged):
    ctx.info = StepInfo(step=step, log=True)
    ctx.last_log = {"train/flip_rate": rates[step]}
    chore.fn(ctx)
  assert written == [(3, {"train/flip_rate_warning": 0.0}),
                     (6, {"train/flip_rate_warning": 1.0}),    # 2 high logs in a row
                     (9, {"train/flip_rate_warning": 0.0}),
                     (12, {"train/flip_rate_warning": 0.0})]
  ctx.sparse_phase, ctx.info = False, StepInfo(step=14, log=True)
  chore.fn(ctx)
  assert len(written) == 4                                      # dense fine-tuning: silent
  assert registry.get_method("ste").chores(_facts(0.0, 2)) == []
  assert registry.get_method("dense").chores(facts) == []


def test_the_warning_patience_must_be_positive():
  with pytest.raises(ValueError, match="patience must be >= 1"):
    flip_monitor.FlipRateMonitor(threshold=0.1, patience=0)
  # A subclass of the base method (SR-STE without its controller) keeps the one chore.
  assert [c.name for c in registry.get_method("sr_ste").chores(_facts(0.1, 3))] == [
      "flip-rate warning"]
