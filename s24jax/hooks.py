"""Periodic chores of the training loop as hooks, and the clock that keeps them out of tokens/s.

A `Hook` is a function of a `Context` (what the loop shows a chore: the steps done, the
state, the last log, a metrics writer; s24jax/loop.py's `Run` is one) with a schedule: after
the train step of every `every`-th step (and the last), or before a step (it then sees the
state before the update). The loop runs the due ones in order; every periodic
action (log, eval, checkpoint, a method's chores) is one, so the loop body stays a few lines
and knows no method.

Time: a hook is either training work (`training=True`, e.g. MST's topology update: its time
counts in tokens/s) or not (eval, checkpoints, statistics, plots). The loop runs the latter
inside `Clock.excluded`, which first waits for the queued train steps, so their time is
charged to training, and then leaves the hook's own time out of the next tokens/s reading.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Mapping, Protocol

import jax


def itstime(step: int, every: int, total: int, *, last: bool = True) -> bool:
  """Whether a chore with period `every` runs at `step` (1-based steps done): every `every`
  steps, and at the last step if `last`. every <= 0 never runs (except at the last)."""
  if step == total and last:
    return True
  return every > 0 and step % every == 0


class Context(Protocol):
  """What a hook sees of the run. `step` is the number of optimizer steps done: before a
  step, the index of the step about to run; after it, that index + 1."""
  step: int
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
class Hook:
  """`fn(run)` when due. `every`: after every every-th step (and the last); `due(step)`
  overrides that; `before_step`: run before the train step (step 0-based, sees the batch)."""
  fn: Callable[[Context], None]
  every: int = 1
  before_step: bool = False
  training: bool = False          # its time is training work (counted in tokens/s)
  due: Callable[[int], bool] | None = None
  name: str = ""

  def is_due(self, step: int, total: int) -> bool:
    if self.due is not None:
      return self.due(step)
    return itstime(step, self.every, total)


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


def run_hooks(run, hooks: list[Hook], *, before_step: bool) -> None:
  """Runs the due hooks of one side of a train step, each timed as it asks."""
  for hook in hooks:
    if hook.before_step != before_step or not hook.is_due(run.step, run.total):
      continue
    if hook.training:
      hook.fn(run)
    else:
      with run.clock.excluded(run.state):
        hook.fn(run)
