"""Tests for s24jax/chores.py: when a chore runs (`itstime`, `Chore.is_due`, `run_chores` on
each side of the step, against schedules listed by hand) and what the `Clock` charges to
training (a fake time source, exact arithmetic)."""
import jax.numpy as jnp
import pytest

from s24jax import chores as chores_lib
from s24jax.step_info import StepInfo
from s24jax.step_info import itstime


def test_itstime():
  assert [s for s in range(1, 11) if itstime(s, 3, 10)] == [3, 6, 9, 10]
  assert [s for s in range(1, 11) if itstime(s, 0, 10)] == [10]
  assert [s for s in range(1, 11) if itstime(s, 3, 10, last=False)] == [3, 6, 9]


def test_clock_leaves_excluded_time_out(monkeypatch):
  # A fake time source: exact arithmetic, independent of how loaded the machine is.
  now = [100.0]
  monkeypatch.setattr(chores_lib.time, "time", lambda: now[0])
  clock = chores_lib.Clock()
  now[0] += 0.05                        # training
  with clock.excluded(jnp.zeros(3)):
    now[0] += 0.3                       # eval, checkpoint...
  now[0] += 0.02                        # training
  assert clock.lap() == pytest.approx(0.07)
  with clock.excluded(jnp.zeros(3)):
    now[0] += 0.1
  assert clock.lap() == pytest.approx(1e-9)   # nothing but excluded time: the floor


def test_chores_run_when_due_and_on_their_side():
  calls = []

  class FakeRun:
    info, total, state = None, 6, jnp.zeros(())
    clock = chores_lib.Clock()

  run = FakeRun()
  chores = [chores_lib.Chore(lambda r: calls.append(("after", r.info.next_step)), every=2),
            chores_lib.Chore(lambda r: calls.append(("before", r.info.step)), before_step=True,
                             training=True, due=lambda info: info.step % 3 == 0)]
  for step in range(6):
    run.info = StepInfo(step=step, log=False)
    chores_lib.run_chores(run, chores, before_step=True)
    chores_lib.run_chores(run, chores, before_step=False)
  assert calls == [("before", 0), ("after", 2), ("before", 3), ("after", 4), ("after", 6)]


def test_a_chore_is_due_after_every_kth_step_and_the_last():
  """`every` reads the steps done (next_step), not the index: after steps 3, 6, 9 and 10."""
  chore = chores_lib.Chore(lambda r: None, every=3)
  due = [i for i in range(10) if chore.is_due(StepInfo(step=i, log=False), 10)]
  assert [i + 1 for i in due] == [3, 6, 9, 10]
  logged = chores_lib.Chore(lambda r: None, every=1, due=lambda info: info.log)
  assert logged.is_due(StepInfo(step=4, log=True), 10)
  assert not logged.is_due(StepInfo(step=4, log=False), 10)   # `due` overrides `every`
