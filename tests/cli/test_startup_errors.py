"""The first seconds of the commands of s24jax/cli/ (issue 41): Ctrl-C while one imports (jax,
flax: seconds) is one line and exit code 75, nothing written, never Python's 130 and an import
traceback (command.guard_startup, the first thing each does); and flops' arguments, which it
reads itself."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from s24jax import errors
from s24jax.cli import command
from s24jax.cli import flops

from faults import snapshot

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMANDS = {   # each one's README command line ({tmp}: a folder of the test's)
    "s24jax.cli.evaluate": ["--workdir", "{tmp}", "--tasks", "piqa", "--json", "{tmp}/r.json"],
    "s24jax.cli.export": ["--workdir", "{tmp}", "--out", "{tmp}/hf"],
    "s24jax.cli.flops": ["experiments/gpt2_s_ste.py:tiny"],
}


def _catches_sigterm(pid: int) -> bool:
  """Whether the process has a handler for SIGTERM (/proc's SigCgt mask): Python leaves it at
  the default, so a handler there is guard_startup's."""
  with open(f"/proc/{pid}/status", encoding="ascii") as f:
    mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
  return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("module", list(COMMANDS))
def test_ctrl_c_while_starting(module, tmp_path):
  before = snapshot(tmp_path)
  argv = [a.format(tmp=tmp_path) for a in COMMANDS[module]]
  proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.monotonic() + 60
  while not _catches_sigterm(proc.pid):   # guarded: the heavy imports start now
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
    time.sleep(0.002)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == errors.EXIT_PREEMPTED, (out, err)
  assert err == (f"{module}: stopped by SIGINT while starting; nothing was written. Run it "
                 f"again (exit code {errors.EXIT_PREEMPTED})\n"), err
  assert out == "" and snapshot(tmp_path) == before


def test_flops_takes_the_config_file_bare(capsys):
  """launch.py's `--config FILE` given to flops: one line saying how flops reads it."""
  code = command.run(flops.main, ["--config", "experiments/gpt2_s_ste.py:tiny"],
                     name="s24jax.cli.flops")
  err = capsys.readouterr().err
  assert code == errors.EXIT_USER and err.count("\n") == 1, err
  assert "unknown option '--config': the config file comes first, without a flag" in err
