"""The perf tools as processes (`python -m s24jax.perf.<tool>`): Ctrl-C from the first instant
is one line and exit code 75, nothing written (s24jax/cli/command.py guard_startup, the first
thing each tool runs, before its imports); a module that is a part of a tool, not a command
(plan_gemms, step_census, roofline, hlo_text), answers `--help` with its usage and anything
else with one line naming the command to run (s24jax/perf/not_a_command.py)."""
import importlib
import os
import runpy
import signal
import subprocess
import sys
import time
import warnings

import pytest

from s24jax import errors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "experiments", "gpt2_s_ste.py") + ":tiny"


def _catches_sigterm(pid: int) -> bool:
  """Whether the process has a handler for SIGTERM (Linux: /proc/<pid>/status SigCgt), which
  guard_startup installs: from then on a Ctrl-C is the command's. Before it, Python leaves
  SIGTERM to the kernel."""
  try:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("SigCgt:"):
          return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
  except FileNotFoundError:
    pass
  return False


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("tool, argv", [
    ("plan", ["--config", TINY, "--json", "OUT/plan.json"]),
    ("gpu_report", ["--smoke", "--out", "OUT"]),
    ("step_time", ["report", "--rows", "", "--json", "OUT/p.json"]),
    ("compression_traffic", ["--json", "OUT/t.json"]),
    ("plan_gemms", []),
])
def test_ctrl_c_while_starting_is_one_line_and_75(tool, argv, tmp_path):
  """SIGINT the moment the tool has guarded itself (inside its imports: jax's take a second
  or more): exit 75, one line, no traceback, nothing written."""
  out = tmp_path / "out"
  proc = subprocess.Popen([sys.executable, "-m", f"s24jax.perf.{tool}",
                           *(a.replace("OUT", str(out)) for a in argv)], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 60
  while proc.poll() is None and not _catches_sigterm(proc.pid) and time.time() < deadline:
    time.sleep(0.002)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == errors.EXIT_PREEMPTED, err
  assert err.count("\n") == 1 and "Traceback" not in err and "SIGINT" in err, err
  assert err.startswith(f"s24jax.perf.{tool}: ") and not out.exists(), err


@pytest.mark.slow
def test_plan_gemms_help_prints_its_usage():
  """`python -m s24jax.perf.plan_gemms --help` (it imports jax: a process of its own)."""
  run = subprocess.run([sys.executable, "-m", "s24jax.perf.plan_gemms", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert run.returncode == 0 and run.stderr == "", run.stderr
  assert "sparse GEMMs" in run.stdout and "usage: python -m s24jax.perf.plan " in run.stdout
  bare = subprocess.run([sys.executable, "-m", "s24jax.perf.plan_gemms"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert bare.returncode == errors.EXIT_USER and bare.stdout == "", bare
  assert bare.stderr.count("\n") == 1 and "python -m s24jax.perf.plan " in bare.stderr


@pytest.mark.parametrize("module", ["step_census", "roofline", "hlo_text", "plan_gemms"])
def test_a_part_of_a_tool_answers_help_with_its_usage(module, capsys, monkeypatch):
  """Each such module run as `python -m` (in process, runpy: the modules are imported here
  already): --help prints its docstring and a usage naming a real command, exit 0; other
  arguments are one line naming that command, exit 2."""
  name = f"s24jax.perf.{module}"
  for argv, code in ((["--help"], 0), (["--json", "x"], errors.EXIT_USER)):
    monkeypatch.setattr(sys, "argv", [name, *argv])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as e:
      warnings.simplefilter("ignore", RuntimeWarning)   # runpy: "found in sys.modules"
      runpy.run_module(name, run_name="__main__")
    assert e.value.code == code
  out, err = capsys.readouterr()
  doc = importlib.import_module(name).__doc__.strip()
  usage = out[out.index("usage: ") + len("usage: "):].splitlines()[0]
  assert out.startswith(doc) and usage.split()[:3] in (
      ["python", "-m", "s24jax.perf.plan"], ["python", "-m", "s24jax.perf.step_time"]), out
  assert err.count("\n") == 1 and f"run `{usage}`" in err and "(exit code 2)" in err, err
