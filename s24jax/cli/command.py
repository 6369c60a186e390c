"""The one error path of every s24jax command: launch.py, `python -m s24jax.cli.<command>`, the
perf tools' commands and the experiments/ scripts.

  guard_startup(name)  first thing in a command's module, before its heavy imports: from that
                       instant a Ctrl-C (SIGINT) or SIGTERM ends the process with one line and
                       exit code 75, nothing having been written;
  Parser               argparse with one-line errors (exit code 2), the README's;
  run(main, argv)      main under the shared handling (a script ends with
                       `command.exit_with(command.run(main, name=...))`): a UserError or other KnownError is its
                       one line and its exit code (errors.py), a write that fails after the
                       checks one line and 5 (destinations.py), Ctrl-C one line and 75 (main
                       says what is intact by raising `errors.Stopped`-style KnownErrors, or
                       nothing was written), anything else a traceback and 1.

The exit codes are errors.py's (the README's table). This module imports only errors.py and
destinations.py: a command's startup stays fast until guard_startup has run.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from typing import Callable, Sequence

from s24jax import destinations
from s24jax import errors


def _say(name: str, message: str) -> None:
  sys.stderr.write(f"{name}: {' '.join(str(message).split())}\n")
  sys.stderr.flush()


def guard_startup(name: str) -> None:
  """Until `run` takes over: SIGINT / SIGTERM end the process at once, one line, exit 75
  (nothing is written while a command starts: its imports and argument checks)."""
  def stop(signum, frame):   # pylint: disable=unused-argument
    _say(name, f"stopped by {signal.Signals(signum).name} while starting; nothing was "
               f"written. Run it again (exit code {errors.EXIT_PREEMPTED})")
    os._exit(errors.EXIT_PREEMPTED)   # pylint: disable=protected-access
  signal.signal(signal.SIGINT, stop)
  signal.signal(signal.SIGTERM, stop)


class Parser(argparse.ArgumentParser):
  """argparse whose errors are one line naming the argument (exit code 2); --help as usual."""

  def error(self, message: str):
    # prog is a module ('s24jax.perf.plan' or 'python -m s24jax.perf.plan') or a script path.
    name = self.prog.removeprefix("python -m ")
    script = name.endswith(".py") or "/" in name or "." not in name
    runnable = name if script else f"python -m {name}"
    _say(name, f"{message} ({runnable} --help lists the arguments) "
               f"(exit code {errors.EXIT_USER})")
    sys.exit(errors.EXIT_USER)


def exit_with(code: int) -> None:
  """sys.exit(code), deaf to SIGINT / SIGTERM from here on: a command that has finished says
  so, and a signal while the interpreter shuts down must not turn its code into 130."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  sys.exit(code)


def _interrupted(signum, frame):   # pylint: disable=unused-argument
  raise KeyboardInterrupt(signal.Signals(signum).name)


def run(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None,
        *, name: str, stopped: str = "nothing it wrote is partial: run it again",
        writes_under: str | None = None) -> int:
  """main(argv)'s exit code under the shared handling (module docstring). `stopped`: what a
  Ctrl-C leaves, said in its line (the command's writes are whole-or-nothing).
  `writes_under`: the folder the command writes in, where a permission or missing-folder
  error is a failed write too (elsewhere only a full disk, a quota or a read-only filesystem
  is: a read that fails that way is a bug's, with its traceback)."""
  before = {sig: signal.signal(sig, _interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    return _handled(main, argv, name, stopped, writes_under)
  finally:   # an in-process caller (a test, a notebook) gets its own handlers back
    for sig, handler in before.items():
      signal.signal(sig, handler)


def _handled(main, argv, name: str, stopped: str, writes_under: str | None) -> int:
  try:
    return int(main(argv) or 0)
  except KeyboardInterrupt as e:
    which = str(e) or "SIGINT"
    _say(name, f"stopped by {which}; {stopped} (exit code {errors.EXIT_PREEMPTED})")
    return errors.EXIT_PREEMPTED
  except errors.KnownError as e:
    _say(name, f"{e} (exit code {e.exit_code})")
    return e.exit_code
  except OSError as e:
    if not (e.errno in destinations._WRITE_ONLY   # pylint: disable=protected-access
            or (writes_under and destinations.is_write_error(e, under=writes_under))):
      raise
    error = destinations.write_failed(e, os.fspath(e.filename or "a file"),
                                      "What was there before is intact")
    _say(name, f"{error} (exit code {error.exit_code})")
    return error.exit_code
  except SystemExit:   # argparse's --help (0) and its errors (Parser.error: 2), as they are
    raise
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()
    _say(name, "internal error: the traceback above is s24jax's or a library's, not a "
               f"mistake in the command line (exit code {errors.EXIT_CRASH})")
    return errors.EXIT_CRASH
