"""Periodic chores of the training loop, and the clock that keeps them out of tokens/s.

A `Chore` is a function of a `Context` (what the loop shows a chore: the step's `StepInfo`,
the state, the last log, a metrics writer; s24jax/training/loop.py's `Run` is one) with a schedule:
after the train step of every `every`-th step (and the last), or before a step (it then sees
the state before the update and the step's batch), or whenever `due(info)` says. The loop
runs the due ones in order; every periodic action (log, eval, checkpoint, a method's chores)
is one, so the loop body stays a few lines and knows no method. ("Hook" is reserved for the
override points of a method, s24jax/methods/base.py.)

Time: a chore is either training work (`training=True`, e.g. the FLOP count: its time counts
in tokens/s) or not (eval, checkpoints, statistics, plots). The loop runs the latter inside
`Clock.excluded`, which first waits for the queued train steps, so their time is charged to
training, and then leaves the chore's own time out of the next tokens/s reading.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Mapping, Protocol

import jax

from s24jax.step_info import StepInfo
from s24jax.step_info import itstime


class Context(Protocol):
  """What a chore sees of the run."""
  info: StepInfo                   # the step the chore runs before or after
  state: Any                       # the TrainState (s24jax/state.py)
  workdir: str
  last_log: Mapping[str, float]    # the scalars of the latest 'log' (empty before the first)

  @property
  def metrics_path(self) -> str:   # the run's metrics.jsonl
    ...

  @property
  def sparse_phase(self) -> bool:  # False while the step's model is dense (dense fine-tuning)
    ...

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    ...


@dataclasses.dataclass
class Chore:
  """`fn(ctx)` when due. `every`: after every every-th step (and the last); `due(info)`
  overrides that; `before_step`: run before the train step (sees the batch)."""
  fn: Callable[[Context], None]
  every: int = 1
  before_step: bool = False
  training: bool = False          # its time is training work (counted in tokens/s)
  due: Callable[[StepInfo], bool] | None = None
  name: str = ""

  def is_due(self, info: StepInfo, total: int) -> bool:
    if self.due is not None:
      return bool(self.due(info))
    return bool(itstime(info.next_step, self.every, total))


class Clock:
  """Training seconds between two `lap()`s: wall time minus what ran inside `excluded`."""

  def __init__(self):
    self._start = time.time()
    self._excluded = 0.0

  @contextlib.contextmanager
  def excluded(self, state: Any):
    jax.block_until_ready(state)   # queued train steps are training time: finish them first
    t0 = time.time()
    try:
      yield
    finally:
      self._excluded += time.time() - t0

  def lap(self) -> float:
    now = time.time()
    seconds = now - self._start - self._excluded
    self._start, self._excluded = now, 0.0
    return max(seconds, 1e-9)


def run_chores(run, chores: list[Chore], *, before_step: bool) -> None:
  """Runs the due chores of one side of the train step `run.info`, each timed as it asks."""
  for chore in chores:
    if chore.before_step != before_step or not chore.is_due(run.info, run.total):
      continue
    if chore.training:
      chore.fn(run)
    else:
      with run.clock.excluded(run.state):
        chore.fn(run)
