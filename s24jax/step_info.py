"""When things happen: the loop decides it once per step and passes a `StepInfo` on.

Two counts name a step, and every schedule says which it reads: `step`, the 0-based index of
the optimizer step (the steps done before it), and `next_step`, the steps done once it ran.
A period of k ("every k steps") is always `itstime(next_step, k, total)`: after steps k, 2k,
... and the last. The loop builds one `StepInfo` per step (`StepInfo.at`); the chores before
and after the step see it on the host, and the train step hands the same value to the
method's `update` on the device (a pytree: its fields become traced scalars there, so
methods write `info.next_step % k == 0` once for both sides).
"""
from __future__ import annotations

from typing import Any

import flax.struct


def itstime(steps_done: Any, every: int, total: int, *, last: bool = True) -> Any:
  """Whether a chore with period `every` runs once `steps_done` steps are done: every `every`
  steps, and after the last step if `last`. every <= 0 never runs (except at the last)."""
  if steps_done == total and last:
    return True
  return every > 0 and steps_done % every == 0


@flax.struct.dataclass
class StepInfo:
  """One optimizer step as the loop decided it (ints and bools on the host, traced scalars
  inside the jitted step)."""
  step: Any          # int32: the step's 0-based index (optimizer steps done before it)
  log: Any           # bool: the loop logs after this step (its metrics are read)

  @property
  def next_step(self) -> Any:
    """The optimizer steps done once this step ran (the step count chores log at)."""
    return self.step + 1

  @classmethod
  def at(cls, step: int, *, log_every: int, total: int) -> "StepInfo":
    """The loop's decision for the step of index `step`."""
    return cls(step=step, log=bool(itstime(step + 1, log_every, total)))
