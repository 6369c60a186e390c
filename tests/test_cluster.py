"""Runs that survive a cluster: preemption (SIGTERM), one run per workdir, damaged checkpoints,
a full disk, one metrics history across resumes, the multi-host flags. Signals and second
processes go through launch.py in subprocesses; the rest runs the loop in-process."""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util

from s24jax import checkpoint as ckpt_lib
from s24jax import config_files
from s24jax import loop
from s24jax import model as model_lib
from s24jax import preemption
from s24jax import train
from s24jax import workdir as workdir_lib

from tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24
# Log every 5 steps, checkpoint only at the start and the end: a stop at any other step leaves
# unlogged steps behind, and only the preemption checkpoint can resume it.
SETTINGS = dict(steps=STEPS, log_every=5, checkpoint_every=100)


def _config(data_cache, **overrides):
  return tiny_config("s_ste", workdir_cache=data_cache, **{**SETTINGS, **overrides})


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _losses(workdir):
  return {r["step"]: r["train/loss"] for r in _records(workdir) if "train/loss" in r}


def _assert_each_step_once(workdir):
  seen = {}
  for r in _records(workdir):
    for k in r:
      if k != "step":
        assert (r["step"], k) not in seen, f"step {r['step']} {k} written twice"
        seen[(r["step"], k)] = True


def _digest(path):
  out = {}
  for root, _, files in os.walk(path):
    for name in files:
      p = os.path.join(root, name)
      with open(p, "rb") as f:
        out[os.path.relpath(p, path)] = hash(f.read())
  return out


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


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, data_cache):
  workdir = str(tmp_path_factory.mktemp("undisturbed"))
  final = loop.train_and_evaluate(_config(data_cache), workdir)
  return workdir, final


def test_sigterm_and_a_second_run_on_the_same_workdir(undisturbed, tmp_path, data_cache):
  """A run holds the workdir: a second launch on it exits 3 at once, naming the holder. Then
  SIGTERM: the first saves the step it is on and exits 75; the same command again finishes
  with the losses of an undisturbed run at every logged step (log_every=5: the unlogged
  steps before the stop count), each step once."""
  workdir = str(tmp_path / "preempted")
  cmd = _launch_cmd(workdir, _config(data_cache))
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
  assert _losses(workdir) == _losses(undisturbed[0])   # every logged step, bit for bit
  _assert_each_step_once(workdir)
  # The same command: no resumed config; the lock is gone.
  assert not [n for n in os.listdir(workdir) if n.startswith("config.resumed_at_")]
  assert not os.path.exists(lock)


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, data_cache):
  workdir = str(tmp_path / "stale")
  os.makedirs(workdir)
  path = os.path.join(workdir, workdir_lib.LOCK_NAME)
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  with open(path, "w") as f:
    json.dump({"host": socket.gethostname(), "pid": dead.pid, "started": "earlier"}, f)
  with workdir_lib.WorkdirLock(workdir):
    with open(path) as f:
      assert json.load(f)["pid"] == os.getpid()   # taken over
  assert not os.path.exists(path)                 # and released
  # A live holder (this process's parent, seen as another run) is refused with its name,
  # by the loop, before it writes anything.
  with open(path, "w") as f:
    json.dump({"host": socket.gethostname(), "pid": os.getppid(), "started": "now"}, f)
  before = _digest(workdir)
  with pytest.raises(workdir_lib.WorkdirLockedError, match=f"pid {os.getppid()}"):
    loop.train_and_evaluate(_config(data_cache, steps=4), workdir)
  assert _digest(workdir) == before


def _truncate_largest(directory):
  files = [os.path.join(r, n) for r, _, ns in os.walk(directory) for n in ns]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.truncate(min(1000, os.path.getsize(largest) // 2))
  return largest


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    undisturbed, tmp_path, data_cache):
  workdir = str(tmp_path / "damaged")
  # Checkpoints on log steps (5, 10, ..., 20, 24; 3 kept), so a resume logs as before.
  loop.train_and_evaluate(_config(data_cache, checkpoint_every=5), workdir)
  os.remove(os.path.join(workdir, "final_metrics.json"))   # as if killed before the end
  _truncate_largest(os.path.join(workdir, "checkpoints", str(STEPS)))
  final = loop.train_and_evaluate(_config(data_cache, checkpoint_every=5), workdir)
  assert _losses(workdir) == _losses(undisturbed[0])
  _assert_each_step_once(workdir)
  aside = os.listdir(os.path.join(workdir, ckpt_lib.DAMAGED_DIR))
  assert len(aside) == 1 and aside[0].startswith(f"{STEPS}."), aside   # moved, not deleted
  assert final["step"] == STEPS
  superseded = os.path.join(workdir, "metrics.superseded.jsonl")
  assert STEPS in {json.loads(l)["step"] for l in open(superseded)}   # kept, out of the way
  # Now none readable: a clear error, and nothing in the workdir changes.
  os.remove(os.path.join(workdir, "final_metrics.json"))
  for step in os.listdir(os.path.join(workdir, "checkpoints")):
    _truncate_largest(os.path.join(workdir, "checkpoints", step))
  before = _digest(workdir)
  with pytest.raises(ckpt_lib.NoReadableCheckpointError, match="Nothing in the workdir"):
    loop.train_and_evaluate(_config(data_cache, checkpoint_every=5), workdir)
  assert _digest(workdir) == before


def test_a_full_disk_stops_the_run_and_keeps_the_previous_checkpoint(
    tmp_path, data_cache, monkeypatch):
  workdir = str(tmp_path / "full_disk")
  real = ocp.StandardCheckpointHandler.async_save
  calls = []

  def failing(self, *args, **kwargs):   # the third save (step 6) finds the disk full
    calls.append(1)
    if len(calls) >= 3:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(self, *args, **kwargs)

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", failing)
  with pytest.raises(ckpt_lib.CheckpointSaveError, match="No space left") as e:
    loop.train_and_evaluate(_config(data_cache, checkpoint_every=3), workdir)
  assert "step 3, is intact" in str(e.value)
  monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", real)
  method, model_cfg, tx_fn = loop.build(_config(data_cache))
  fresh = train.fresh_state(model_lib.GPT2(model_cfg), tx_fn, 0)
  ckpt = ckpt_lib.Checkpointer(workdir)
  assert ckpt.latest_step() == 3
  assert int(ckpt.restore_or_init(fresh).step) == 3
  ckpt.close()


def test_a_workdir_from_before_the_rename_is_refused_with_the_new_key(tmp_path, data_cache):
  workdir = str(tmp_path / "old")
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"sparsity": {"projection": "s_ste"}}, f)
  with pytest.raises(ValueError, match="sparsity.method"):
    loop.train_and_evaluate(_config(data_cache, steps=2), workdir)


def test_explicit_cluster_flags_imply_distributed(tmp_path, data_cache):
  workdir = str(tmp_path / "flags")
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  cmd = _launch_cmd(workdir, _config(data_cache, steps=1)) + [
      f"--coordinator_address=localhost:{port}", "--num_processes=1", "--process_id=0"]
  run = subprocess.run(cmd, env=ENV, cwd=REPO, timeout=300, capture_output=True, text=True)
  out = run.stdout + run.stderr
  assert run.returncode == 0, out[-3000:]
  assert "running with --distributed" in out and "in 1 process(es)" in out
