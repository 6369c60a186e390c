"""The report's record: one JSON object per line, appended and synced the moment it exists.

Every section writes its rows here as it goes (the in-process sections in their own process,
the pytest sections through the plugin pytest_rows.py), so a failure, a time cap, a SIGTERM or
a SIGKILL loses at most the row in progress; the markdown is regenerated from this file
(markdown.py). A row:

  {"section": "gemms", "row": "d=768 t=8192 fc bf16", "status": "ok", "t": 12.3, ...fields}

status: 'ok'; 'failed' with 'error' (the exception's type and the first line of its message);
'skipped' with 'reason' (a budget, a missing GPU or library); 'cut' (a section stopped at its
time cap: the rows before it are what finished). 't': seconds since the report started
(S24JAX_GPU_REPORT_T0, the epoch second the command began).

A row is written whole or not at all: every byte of its line (a write to a nearly full disk
may take only part of it), cut back if the rest cannot be written (destinations.appending);
a line left cut by a kill starts no row glued to it (the next row begins a line of its own),
and `read` skips such a line, keeping a whole row written after it on the same line by an
older version. (On a full disk the cut-back may also drop a row another process of the report
appended meanwhile: none of theirs can be written there either.)
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from s24jax import destinations

ENV_JSONL = "S24JAX_GPU_REPORT_JSONL"     # the record's path, for the processes a section starts
ENV_T0 = "S24JAX_GPU_REPORT_T0"


def error_line(e: BaseException) -> str:
  """'TypeName: the first line of the message' (a row's 'error')."""
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def append(path: str, row: dict[str, Any]) -> dict[str, Any]:
  """Appends `row` (with 't') as one line, whole or not at all (the module docstring), synced
  before returning it; OSError if it cannot be written (the file then as it was)."""
  t0 = float(os.environ.get(ENV_T0, "0") or 0)
  row = {**row, "t": round(time.time() - t0, 1) if t0 else None}
  line = (json.dumps(row, default=_plain) + "\n").encode()
  with destinations.appending(path):   # an exception: the file cut back to its length
    # O_APPEND: each write goes to the end, never into another process's row.
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      size = os.fstat(fd).st_size
      if size and os.pread(fd, 1, size - 1) != b"\n":   # a row cut by a kill
        line = b"\n" + line
      while line:                  # os.write may take part of it (a nearly full disk)
        line = line[os.write(fd, line):]
      os.fsync(fd)
    finally:
      os.close(fd)
  return row


def _plain(v):
  """NumPy scalars and anything else json cannot write, as a number or text."""
  try:
    return float(v)
  except (TypeError, ValueError):
    return str(v)


def _row(line: bytes) -> dict[str, Any] | None:
  """The row a line holds, or None (not one: cut, not UTF-8, not JSON, not a row)."""
  try:
    row = json.loads(line.decode("utf-8"))
  except ValueError:              # UnicodeDecodeError is one
    return None
  return (row if isinstance(row, dict) and isinstance(row.get("section"), str) and "row" in row
          else None)


def read(path: str) -> list[dict[str, Any]]:
  """Every complete row of the record: a line cut by a kill or a full disk is left out, and a
  whole row glued after one (an older version's append) kept."""
  rows = []
  if not os.path.exists(path):
    return rows
  with open(path, "rb") as f:
    for line in f:
      row = _row(line)
      glued = line.rfind(b'{"section"', 1)
      if row is None and glued > 0:
        row = _row(line[glued:])
      if row is not None:
        rows.append(row)
  return rows


class Section:
  """The rows of one section, appended to the record at `path`."""

  def __init__(self, path: str, name: str):
    self.path, self.name = path, name

  def ok(self, row: str, **fields) -> dict:
    return append(self.path, {"section": self.name, "row": row, "status": "ok", **fields})

  def failed(self, row: str, e: BaseException, **fields) -> dict:
    return append(self.path, {"section": self.name, "row": row, "status": "failed",
                              "error": error_line(e), **fields})

  def skipped(self, row: str, reason: str, **fields) -> dict:
    return append(self.path, {"section": self.name, "row": row, "status": "skipped",
                              "reason": reason, **fields})

  def cut(self, reason: str) -> dict:
    return append(self.path, {"section": self.name, "row": "(time cap)", "status": "cut",
                              "reason": reason})

  def guarded(self, row: str, measure: Callable[[], dict], **fields) -> dict:
    """measure()'s fields as an 'ok' row, or a 'failed' row with its error: the section
    goes on to its next row either way."""
    start = time.time()
    try:
      out = measure()
    except Exception as e:  # pylint: disable=broad-except  (recorded; the next row runs)
      return self.failed(row, e, seconds=round(time.time() - start, 1), **fields)
    return self.ok(row, **fields, **out, seconds=round(time.time() - start, 1))
