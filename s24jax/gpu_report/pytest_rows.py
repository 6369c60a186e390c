"""A pytest plugin (`-p s24jax.gpu_report.pytest_rows`): each test's outcome appended to the
report's record the moment the test ends, so a run stopped at its time cap still leaves the
outcome of every test that finished (a JUnit XML file is written only at the end).

Active only when S24JAX_GPU_REPORT_JSONL names the record (rows.ENV_JSONL) and
S24JAX_GPU_REPORT_SECTION the section; under pytest-xdist only the controller writes (it
receives every worker's reports). A row per test: 'row' the node id, 'status' ok / failed /
skipped, 'outcome' pytest's (passed, failed, skipped, error: a setup or teardown failure),
'seconds', and for a failure 'error': its first 'E ' line (the assertion or exception).
"""
from __future__ import annotations

import os

from s24jax.gpu_report import rows

ENV_SECTION = "S24JAX_GPU_REPORT_SECTION"
_STATUS = {"passed": "ok", "failed": "failed", "skipped": "skipped", "error": "failed"}
_WORKER = [False]      # an xdist worker (set in pytest_configure; its env may be inherited)


def pytest_configure(config):
  _WORKER[0] = hasattr(config, "workerinput")


def _first_error(report) -> str:
  text = getattr(report, "longreprtext", "") or ""
  for line in text.splitlines():
    if line.startswith("E "):
      return line[1:].strip()[:300]
  lines = [l for l in text.splitlines() if l.strip()]
  return lines[-1].strip()[:300] if lines else ""


def _skip_reason(report) -> str:
  longrepr = report.longrepr
  if isinstance(longrepr, tuple) and len(longrepr) == 3:
    return str(longrepr[2]).removeprefix("Skipped: ")[:300]
  return _first_error(report)


def pytest_runtest_logreport(report):
  path, section = os.environ.get(rows.ENV_JSONL), os.environ.get(ENV_SECTION)
  if not path or not section or _WORKER[0]:
    return
  if report.when == "call":
    outcome = report.outcome
  elif report.failed:                      # setup or teardown
    outcome = "error"
  elif report.when == "setup" and report.skipped:
    outcome = "skipped"
  else:
    return
  row = {"section": section, "row": report.nodeid, "status": _STATUS[outcome],
         "outcome": outcome, "seconds": round(report.duration, 2)}
  if outcome == "skipped":
    row["reason"] = _skip_reason(report)
  elif outcome in ("failed", "error"):
    row["error"] = _first_error(report)
    if report.when != "call":
      row["when"] = report.when
  rows.append(path, row)
