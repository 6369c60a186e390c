"""How a perf tool writes the file it was asked for (the planner's --json, the step-time
model's predictions and census files, the traffic records): after the checks before the work
(args.output_file: a folder that exists or can be made, an existing file only if it is the
tool's own output), `write` makes the folder if it is missing and writes the file whole or
not at all with the same guard (destinations.write_atomic); a write that fails meanwhile (a
full disk, the folder made read-only or removed) is one line and exit code 5
(destinations.WriteError) saying what is intact, never a traceback nor a partial file.
"""
from __future__ import annotations

import os
from typing import Callable

from s24jax import destinations


def write(path: str, data: str | bytes, *, what: str, replaces: Callable[[str], bool],
          intact: str) -> None:
  """`data` to `path` (module docstring); `what` names the file in the errors ('the plan
  report'), `intact` says what a failed write leaves ('the report above is complete')."""
  folder = os.path.dirname(os.path.abspath(path))
  with destinations.writing(f"{what} {path}", intact, under=folder):
    os.makedirs(folder, exist_ok=True)   # the check allowed a folder that can be made
    destinations.write_atomic(path, data, replaces=replaces, what=what)
