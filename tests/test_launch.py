"""Tests for launch.py (with s24jax/preemption.py and the workdir lock it takes), in
subprocesses: a second launch on a held workdir exits 3 naming the holder; SIGTERM saves the
step in flight and exits 75, and the same command then finishes with an undisturbed run's
losses at every logged step, bit for bit (the reference: the same config trained in process
without interruption), each step written once; explicit cluster flags imply --distributed."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from flax import traverse_util

from s24jax import config_files
from s24jax import preemption
from s24jax import workdir as workdir_lib

from train_helpers import STEPS, assert_each_step_once, losses, run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# run_config logs every 5 steps and checkpoints only at the start and the end: a stop at any
# other step leaves unlogged steps behind, and only the preemption checkpoint can resume it.


def _flat(config):
  return {k: v for k, v in traverse_util.flatten_dict(config.to_dict(), sep=".").items()
          if v is not None and not isinstance(v, (tuple, list))}


def _launch_cmd(workdir, config):
  """launch.py on experiments/gpt2_s_ste.py:tiny with overrides that make it `config`."""
  base = os.path.join(REPO, "experiments", "gpt2_s_ste.py") + ":tiny"
  have = _flat(config_files.load_config(base))
  cmd = [sys.executable, os.path.join(REPO, "launch.py"), "--config", base, "--workdir", workdir]
  return cmd + [f"--config.{k}={v}" for k, v in _flat(config).items() if have.get(k) != v]


ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


@pytest.mark.slow
def test_sigterm_and_a_second_run_on_the_same_workdir(undisturbed, tmp_path, data_cache):
  """A run holds the workdir: a second launch on it exits 3 at once, naming the holder. Then
  SIGTERM: the first saves the step it is on and exits 75; the same command again finishes
  with the losses of an undisturbed run at every logged step (log_every=5: the unlogged
  steps before the stop count), each step once."""
  workdir = str(tmp_path / "preempted")
  cmd = _launch_cmd(workdir, run_config(data_cache))
  proc = subprocess.Popen(cmd, env=ENV, cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  lock = os.path.join(workdir, workdir_lib.LOCK_NAME)
  deadline = time.time() + 300
  while not os.path.exists(lock) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  second = subprocess.run(cmd, env=ENV, cwd=REPO, timeout=300, capture_output=True, text=True)
  assert second.returncode == 3, second.stdout[-2000:] + second.stderr[-2000:]
  assert f"pid {proc.pid} on {socket.gethostname()}" in second.stderr + second.stdout
  while (not os.path.exists(os.path.join(workdir, "checkpoints", "0"))
         and proc.poll() is None and time.time() < deadline):
    time.sleep(0.02)   # the step-0 checkpoint: the loop is about to train
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == preemption.EXIT_CODE, out[-3000:]
  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit())
  stopped = steps[-1]
  assert 0 < stopped < STEPS, (steps, out[-2000:])   # a checkpoint of the step it stopped at
  assert f"at step {stopped}" in out
  assert not os.path.exists(os.path.join(workdir, "final_metrics.json"))
  rerun = subprocess.run(cmd, env=ENV, cwd=REPO, timeout=600, capture_output=True, text=True)
  assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
  assert losses(workdir) == losses(undisturbed)   # every logged step, bit for bit
  assert_each_step_once(workdir)
  # The same command: no resumed config; the lock is gone.
  assert not [n for n in os.listdir(workdir) if n.startswith("config.resumed_at_")]
  assert not os.path.exists(lock)


@pytest.mark.slow
def test_explicit_cluster_flags_imply_distributed(tmp_path, data_cache):
  workdir = str(tmp_path / "flags")
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  cmd = _launch_cmd(workdir, run_config(data_cache, steps=1)) + [
      f"--coordinator_address=localhost:{port}", "--num_processes=1", "--process_id=0"]
  run = subprocess.run(cmd, env=ENV, cwd=REPO, timeout=300, capture_output=True, text=True)
  out = run.stdout + run.stderr
  assert run.returncode == 0, out[-3000:]
  assert "running with --distributed" in out and "in 1 process(es)" in out
