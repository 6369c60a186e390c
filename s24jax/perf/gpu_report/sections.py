"""The report's sections, in the order they run, with their share of the budget.

Order: the cheapest facts that say the most first. The environment (seconds; which
libcusparseLt serves); the layout checks (is s24jax's compressed operand the library's, with
the evidence where not: seconds a case, more for the large estimates); the `gpu` tests (every
GPU path's correctness: 50 s with 8 workers on an H200, 2026-11-27); the cuSPARSELt GEMMs (is
a 2:4 GEMM faster, with which compression, than dense and PyTorch's: one row per GEMM, a few
seconds each by gemm_plan.py's estimate); the train steps (what that makes of a step; ~15 s a
row at 124m on the H200, more at Llama 7B's width); the quick suite last, the longest (695 of
its 764 tests in the 130 s it got there) and the one the suite's own run also gives.

Time: the environment gets up to ENVIRONMENT_SECONDS; every other section its share of
what is left of the budget among the sections not yet run (`cap`), so what one leaves unused
goes to the later ones; the last gets the rest. A section whose cap is below its `minimum`
is not started (a skipped row says so). At `--budget 420`: 420 - RESERVE (8, cli.py) - ~2 s
(the report's start) = 410 s; the environment takes ~7 of its 20 (H200, 2026-11-27), leaving
~403 s, shared 0.08 / 0.14 / 0.30 / 0.28 / 0.20 (sum 1.0): layouts ~32 s, `gpu` tests ~56 s,
GEMMs ~121 s, steps ~113 s, quick suite ~81 s (each section's unused seconds moving on to
the later ones). What that reaches, by the sections' own estimates (never checked on a GPU):
the layouts of 124M's weights, of the (768, 65536) MVUE estimate and of one of Llama 7B's
weights (~1.4, ~8.5 and ~8 s a case); 15 GEMM rows, 124M's and Llama 7B's FFN in bf16 and
124M's fc in FP8 (~6 and ~10 s a row; the width-8192 rows, ~35 s each, mostly the algorithm
search's gemm_plan.SEARCH_CALLS GEMM calls, do not fit after them and are skipped); 124m's
Hu et al. pair and the dense steps of the Llama slice and 124m (the Llama slice's Hu et al.
pair needs ~250 s, ~170 s of it the layout checks of its first 'cusparselt' step: steps.py).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys


@dataclasses.dataclass(frozen=True)
class Section:
  name: str
  title: str
  share: float                   # of the budget left (0: a fixed ENVIRONMENT_SECONDS)
  minimum: float                 # seconds: below this the section is skipped for the budget
  pytest: bool = False           # a pytest run (else in-process rows in a child process)


ENVIRONMENT_SECONDS = 20.0     # jax, torch and nvidia-smi: 5-10 s
SECTIONS = (
    Section("environment", "Environment", 0.0, 5.0),
    Section("layouts", "s24jax's compressed layouts against the library", 0.08, 5.0),
    Section("gpu_tests", "`gpu` tests", 0.14, 20.0, pytest=True),
    Section("gemms", "cuSPARSELt GEMMs", 0.30, 20.0),
    Section("steps", "Train steps", 0.28, 25.0),
    Section("quick_suite", "Quick suite on the GPU", 0.20, 30.0, pytest=True),
)
BY_NAME = {s.name: s for s in SECTIONS}
# With --smoke (a CPU): one small file per pytest section.
SMOKE_FILES = {"gpu_tests": "tests/sparse_ops/test_tcgen05_backend.py",
               "quick_suite": "tests/test_step_info.py"}


def cap(name: str, left: float, names: tuple[str, ...]) -> float:
  """Seconds for section `name` out of `left`, shared with the sections `names` (it and
  those after it that will run)."""
  if not BY_NAME[name].share:
    return min(ENVIRONMENT_SECONDS, left)
  shares = sum(BY_NAME[n].share for n in names)
  return left * BY_NAME[name].share / shares


def _workers(smoke: bool) -> list[str]:
  if importlib.util.find_spec("xdist") is None:
    return []
  return ["-n", "2" if smoke else str(max(2, min(8, (os.cpu_count() or 4) // 2)))]


def pytest_command(name: str, smoke: bool, files_dir: str) -> tuple[list[str], dict]:
  """(command, extra environment) of a pytest section."""
  base = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "s24jax.perf.gpu_report.pytest_rows",
          "-p", "no:cacheprovider", f"--junitxml={os.path.join(files_dir, name + '.xml')}"]
  env = {}
  if name == "gpu_tests":
    log_dir = os.path.join(files_dir, "cusparselt_log")
    os.makedirs(log_dir, exist_ok=True)
    env = {"CUSPARSELT_LOG_LEVEL": "1",
           "CUSPARSELT_LOG_FILE": os.path.join(log_dir, "%i.log")}
    args = ["-m", "gpu", *([] if smoke else _workers(smoke))]
  else:
    args = ["-m", "not slow and not gpu", *_workers(smoke)]
  return base + args + ([SMOKE_FILES[name]] if smoke else []), env
