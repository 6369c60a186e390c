"""Stopping cleanly when the cluster asks: SIGTERM (a preemption notice) or SIGINT (Ctrl-C).

One process: the first signal sets a flag; the loop finishes the step in flight (it keeps at
most two steps queued on the device, so that is within a step or two of the signal at any
log_every), writes a checkpoint of that step (waiting for it), flushes the logs and leaves
with `Preempted`, which `launch.py` turns into exit code `EXIT_CODE` (75, EX_TEMPFAIL: "try
again") so that a job script can requeue the run; re-running the same command resumes from
that checkpoint. A signal during the start-up (`Guard.at_once`: the checks before the first
write) stops the run at once, having written nothing. A signal during the run's last step
(no stop left before its end) lets it end as it would have, its final checkpoint saved, and
says so: exit code 0. Each message says the exit code the run then has. A second signal
while it saves is acknowledged and ignored: Orbax writes into a temporary directory and
renames it when complete, so even a SIGKILL then leaves the previous checkpoint intact.

Several processes (jax.distributed): they must stop at the same step, or the hosts would save
different steps. JAX's preemption service (on by default under jax.distributed) catches
SIGTERM on any host, and the hosts agree on the first step all of them can reach
(`multihost_utils.reached_preemption_sync_point`, asked at every step: a local check, no
collective). SIGINT keeps its default meaning there (KeyboardInterrupt on that host).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from s24jax import destinations
from s24jax import errors

EXIT_CODE = errors.EXIT_PREEMPTED


class Preempted(errors.KnownError):
  """The run stopped on a signal after saving the checkpoint of `step` (None: the signal came
  before training started, and nothing was written)."""
  exit_code = EXIT_CODE

  def __init__(self, step: int | None, signum: int | None):
    name = signal.Signals(signum).name if signum else "a preemption notice"
    if step is None:
      super().__init__(f"stopped by {name} before training started; nothing was written. Run "
                       "the same command again to start.")
    else:
      super().__init__(f"stopped by {name} at step {step}; its checkpoint is saved. Run the "
                       "same command again to resume.")
    self.step = step


class Guard:
  """`with Guard() as guard:` ... `if guard.should_stop(step): ...` (module docstring)."""

  def __init__(self):
    self.signum: int | None = None
    self._old = {}
    self._distributed = jax.process_count() > 1
    self._at_once = False
    self.finishing = False   # the run's last step is under way (`should_stop`)

  def __enter__(self) -> "Guard":
    if threading.current_thread() is not threading.main_thread():
      return self   # signal handlers can only be set from the main thread
    # Under jax.distributed, SIGTERM belongs to JAX's preemption service; SIGINT stays default.
    signals = () if self._distributed else (signal.SIGTERM, signal.SIGINT)
    for s in signals:
      self._old[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, old in self._old.items():
      signal.signal(s, old)
    self._old.clear()

  @contextlib.contextmanager
  def at_once(self):
    """Within this block (the start-up: nothing is written yet, nothing to save) a signal
    stops the run at once, as Preempted(None), even inside a long token-cache build."""
    self._at_once = True
    try:
      yield
    except KeyboardInterrupt:
      if self.signum is None:
        raise
      raise Preempted(None, self.signum) from None
    finally:
      self._at_once = False

  def _handle(self, signum, frame) -> None:
    del frame
    if self._at_once:
      self.signum = signum
      raise KeyboardInterrupt   # a BaseException: no library's `except Exception` eats it
    if self.finishing:   # no stop is left before the run's end: it ends as it would have
      logging.warning("%s received during the run's last step: finishing the run as it would "
                      "have ended anyway (exit code %d).", signal.Signals(signum).name,
                      errors.EXIT_OK)
    elif self.signum is None:
      self.signum = signum
      logging.warning("%s received: finishing the current step, then saving a checkpoint "
                      "and stopping (exit code %d).", signal.Signals(signum).name, EXIT_CODE)
    else:
      logging.warning("%s received again: still saving the checkpoint; it is written "
                      "atomically, so stopping now would lose nothing but this step.",
                      signal.Signals(signum).name)

  def should_stop(self, step: int, end: int) -> bool:
    """Whether to stop after `step` steps (every process gives the same answer). `end`: the
    step the run ends at (total_steps, or stop_at_step). Once the next step is the last, no
    stop is left before the end: a signal then says that the run finishes (exit code 0), and
    it does; a stop said before that (exit code 75) is made here, or by `stop_if_asked`."""
    if step + 1 >= end:
      self.finishing = True   # before reading the flag: a signal from here on is told the truth
    if self._distributed:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signum is not None

  def stop_if_asked(self, step: int) -> None:
    """Preempted, if a signal said the run would stop (exit code 75) but it reached its end
    with no check left between (the signal came while it started, one step from the end):
    the stop it said, `step`'s checkpoint being saved."""
    if self.signum is not None:
      raise Preempted(step, self.signum)


# The metrics a stop leaves unlogged, so the resumed run logs what an uninterrupted one would.
PENDING_FILE = "pending_metrics.json"


def save_pending(workdir: str, step: int, pending: list[dict]) -> None:
  """The fetched metrics of the steps since the last log, kept for the resumed run of `step`
  (written whole or not at all: destinations.write_atomic; a preempted run's
  `save_and_stop` calls it)."""
  path = os.path.join(workdir, PENDING_FILE)
  # With their dtypes: the log sums them as the uninterrupted run would (float32, not 64).
  records = [{k: [np.asarray(v).tolist(), str(np.asarray(v).dtype)] for k, v in m.items()}
             for m in pending]
  destinations.write_atomic(path, json.dumps({"step": step, "metrics": records}))


def load_pending(workdir: str, step: int) -> list[dict]:
  """The unlogged metrics a preempted run left for `step` (consumed: the file goes)."""
  path = os.path.join(workdir, PENDING_FILE)
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  if jax.process_index() == 0:
    os.remove(path)
  if data.get("step") != step:
    return []
  return [{k: np.asarray(v, dtype) for k, (v, dtype) in m.items()} for m in data["metrics"]]
