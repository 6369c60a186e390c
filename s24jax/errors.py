"""Errors whose message says everything, and the exit codes of every s24jax command.

A `KnownError` stops a command with one line (its message) and its `exit_code`, no traceback:
the command lines (launch.py, `python -m s24jax.cli.flops`, `python -m s24jax.perf.plan`) catch it and
print it. Anything else is an internal error: its traceback is printed (and, for a run, written
to train.log too) and the command exits with `EXIT_CRASH`, Python's own code for an uncaught
exception.

`UserError` is the one type every validator raises for bad input (the command line, the
config, the data, the workdir, a checkpoint of another config): it names what to change, and
nothing was written when it is raised at start-up. The README's "Exit codes" table lists the
codes below for every command; docs/resuming.md says what each stop leaves in the workdir.

This module imports nothing of s24jax (every layer may raise these).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

EXIT_OK = 0            # done (the planner: the step fits)
EXIT_CRASH = 1         # an internal error: a traceback (Python's code for an uncaught exception)
EXIT_USER = 2          # a user error: bad command line, config, data or workdir; one line
EXIT_LOCKED = 3        # another run holds the workdir (launch.py); nothing was written
EXIT_NON_FINITE = 4    # a non-finite loss or gradient norm stopped the run (launch.py)
EXIT_STORAGE = 5       # a checkpoint could not be saved (a full disk), or none can be read
EXIT_DOES_NOT_FIT = 6  # the planner: the step compiles but does not fit the GPU's memory
EXIT_PREEMPTED = 75    # SIGTERM / SIGINT: the step's checkpoint is saved (EX_TEMPFAIL: requeue)


class KnownError(Exception):
  """A stop the message explains in full: printed as one line, no traceback."""
  exit_code = EXIT_CRASH

  def __init__(self, message: str):
    # One line: the terminal, train.log and a job scheduler's summary all show it whole.
    super().__init__(" ".join(str(message).split()))


class UserError(KnownError, ValueError):
  """Bad input (a command line, config value, data set, workdir): the message names the
  field or file and what to do. A ValueError, so callers that catch those still do."""
  exit_code = EXIT_USER


@contextlib.contextmanager
def user_errors(*types: type[BaseException], context: str = "") -> Iterator[None]:
  """Re-raises the exceptions of `types` (default ValueError) raised inside as `UserError`,
  prefixed with `context`: for validators outside this module's reach (the frozen config
  dataclasses, the data sources), whose message is already the user's. The original stays
  chained (`__cause__`) for a debugger."""
  try:
    yield
  except KnownError:
    raise
  except (types or (ValueError,)) as e:
    text = str(e) if not isinstance(e, KeyError) else str(e.args[0] if e.args else e)
    raise UserError(f"{context}{text}" if context else text) from e
