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
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

ENV_JSONL = "S24JAX_GPU_REPORT_JSONL"     # the record's path, for the processes a section starts
ENV_T0 = "S24JAX_GPU_REPORT_T0"


def error_line(e: BaseException) -> str:
  """'TypeName: the first line of the message' (a row's 'error')."""
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def append(path: str, row: dict[str, Any]) -> dict[str, Any]:
  """Appends `row` (with 't') as one line, flushed and fsynced before returning it."""
  t0 = float(os.environ.get(ENV_T0, "0") or 0)
  row = {**row, "t": round(time.time() - t0, 1) if t0 else None}
  line = json.dumps(row, default=_plain) + "\n"
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    os.write(fd, line.encode())      # one write of the whole line (O_APPEND: never interleaved)
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


def read(path: str) -> list[dict[str, Any]]:
  """Every complete row of the record (a line cut by a kill mid-write is left out)."""
  rows = []
  if not os.path.exists(path):
    return rows
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(row, dict):
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
