"""The report's child processes: every section runs in one, with a time cap.

A child is started in its own process group, so the cap (or the report's own SIGTERM) ends
it and everything it started (pytest-xdist's workers) at once: SIGTERM, then SIGKILL after
KILL_GRACE seconds. An exception while it runs (the report's signal handler raises one) ends it too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

KILL_GRACE = 5.0


def stop(proc: subprocess.Popen) -> None:
  """Ends the child's process group: SIGTERM, then SIGKILL if it is still there."""
  for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, KILL_GRACE)):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      return
    try:
      proc.wait(wait)
      return
    except subprocess.TimeoutExpired:
      continue


def run(cmd: list[str], *, cwd: str, env: dict, log_path: str, timeout: float
        ) -> tuple[int | None, float]:
  """(exit code, or None if it was stopped at `timeout` seconds; seconds it ran), its
  output in `log_path`."""
  start = time.time()
  with open(log_path, "ab") as log:
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
      code = proc.wait(max(timeout, 0.0))
    except subprocess.TimeoutExpired:
      stop(proc)
      code = None
    except BaseException:
      stop(proc)
      raise
  return code, time.time() - start


def tail(log_path: str, lines: int = 20) -> list[str]:
  """The last non-empty lines of a child's log."""
  try:
    with open(log_path, encoding="utf-8", errors="replace") as f:
      text = f.read()[-20000:]
  except OSError:
    return []
  return [l for l in text.splitlines() if l.strip()][-lines:]
