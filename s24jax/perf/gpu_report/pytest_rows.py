"""A pytest plugin (`-p s24jax.perf.gpu_report.pytest_rows`): each test's outcome appended to the
report's record the moment the test ends, so a run stopped at its time cap still leaves the
outcome of every test that finished (a JUnit XML file is written only at the end).

Active only when S24JAX_GPU_REPORT_JSONL names the record (rows.ENV_JSONL) and
S24JAX_GPU_REPORT_SECTION the section; under pytest-xdist only the controller writes (it
receives every worker's reports). A row per test: 'row' the node id, 'status' ok / failed /
skipped, 'outcome' pytest's (passed, failed, skipped, error: a setup or teardown failure),
'seconds', for a failure 'error': its first 'E ' line (the assertion or exception), and for a
test that ran, 'libraries': the libcusparseLt of the process that ran it, as it was when the
test ended (libraries.snapshot, which loads nothing: the serving library is named only where a
test loaded s24jax's handlers; a worker's facts reach the controller in the report's
user_properties).
"""
from __future__ import annotations

import os

import pytest

from s24jax.perf.gpu_report import rows

ENV_SECTION = "S24JAX_GPU_REPORT_SECTION"
_STATUS = {"passed": "ok", "failed": "failed", "skipped": "skipped", "error": "failed"}
_WORKER = [False]      # an xdist worker (set in pytest_configure; its env may be inherited)
_LIBRARIES = "s24jax_libraries"     # the user property carrying a test's libraries


def pytest_configure(config):
  _WORKER[0] = hasattr(config, "workerinput")


def _active() -> bool:
  return bool(os.environ.get(rows.ENV_JSONL) and os.environ.get(ENV_SECTION))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  if call.when == "call" and _active():
    from s24jax.perf.gpu_report import libraries  # pylint: disable=g-import-not-at-top  (jax)
    item.user_properties.append((_LIBRARIES, libraries.snapshot(register=False)))
  yield


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
  if not _active() or _WORKER[0]:
    return
  path, section = os.environ[rows.ENV_JSONL], os.environ[ENV_SECTION]
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
  libraries = dict(report.user_properties).get(_LIBRARIES)
  if libraries is not None:
    row["libraries"] = libraries
  rows.append(path, row)
