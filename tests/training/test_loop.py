"""Tests for s24jax/training/loop.py, end to end on a tiny model: it learns, stops and resumes to the
same losses (in process, from a periodic checkpoint and from the step-0 one, after a stop
before or during the first periodic save, and after a real SIGKILL of launch.py before its
first periodic checkpoint), refuses a checkpoint of another config without touching the
workdir, naming the config fields that differ, stops a diverged run keeping only finite
checkpoints (exit code 4), passes each step's StepInfo (log exactly at the logged steps,
against a brute-force rule) to the train step with at most two steps queued on the device,
logs a method's configure warning once, and on a signal says the exit code it then has (in
the last step: it finishes, 0; before: it stops, 75). The references are an uninterrupted run's
losses, bit for bit, and rules written out here."""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util

from s24jax.training import checkpoint as ckpt_lib
from s24jax import config_files
from s24jax import errors
from s24jax.training import loop
from s24jax.training import preemption
from s24jax.training import validate
from s24jax.training.run_spec import RunSpec
from s24jax.step_info import StepInfo

from tiny import tiny_config
from train_helpers import STEPS, assert_each_step_once, losses, records, run_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _losses(workdir):
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if "train/loss" in r:
        out[r["step"]] = r["train/loss"]
  return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_cache):
  workdir = str(tmp_path_factory.mktemp("full"))
  final = loop.train_and_evaluate(tiny_config("s_ste", steps=6, workdir_cache=data_cache), workdir)
  return workdir, final


@pytest.mark.slow
def test_training_is_finite_and_reduces_loss(uninterrupted):
  workdir, final = uninterrupted
  losses = _losses(workdir)
  assert sorted(losses) == [1, 2, 3, 4, 5, 6]
  assert all(np.isfinite(v) for v in losses.values())
  assert losses[6] < losses[1] - 0.5, losses
  assert np.isfinite(final["val/loss"]) and 0 <= final["train/flip_rate"] <= 1
  for name in ("metrics.jsonl", "metrics.png", "config.json", "final_metrics.json"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(workdir, "tensorboard")))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4", "6"]


@pytest.mark.slow
def test_stop_and_resume_gives_identical_losses(uninterrupted, tmp_path, data_cache):
  workdir = str(tmp_path / "resumed")
  loop.train_and_evaluate(tiny_config("s_ste", steps=6, workdir_cache=data_cache,
                                      overrides={"stop_at_step": 3}), workdir)
  assert sorted(_losses(workdir)) == [1, 2, 3]
  loop.train_and_evaluate(tiny_config("s_ste", steps=6, workdir_cache=data_cache), workdir)
  # step 3 was computed twice (after the kill the run resumes from the step-2 checkpoint)
  assert _losses(workdir) == _losses(uninterrupted[0])
  # The resumed run changed one field: its config names it (s24jax/training/workdir.py).
  with open(os.path.join(workdir, "config.resumed_at_2.json")) as f:
    resumed = json.load(f)
  assert resumed["changed"] == {"stop_at_step": {"was": 3, "now": -1}}
  assert resumed["config"]["total_steps"] == 6


def _tree_digest(path):
  h = hashlib.sha256()
  for root, _, files in sorted(os.walk(path)):
    for f in sorted(files):
      p = os.path.join(root, f)
      h.update(p.encode())
      with open(p, "rb") as fh:
        h.update(fh.read())
  return h.hexdigest()


@pytest.mark.slow
def test_mismatched_checkpoint_is_a_clear_error_and_nothing_changes(uninterrupted, data_cache):
  workdir = uninterrupted[0]
  before = _tree_digest(workdir)
  cfg = tiny_config("s_ste", steps=8, workdir_cache=data_cache, overrides={"model.d_model": 64})
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match="does not match this config") as e:
    loop.train_and_evaluate(cfg, workdir)
  # In the user's terms: the config fields that differ from the workdir's config.json.
  assert "model.d_model: 32 -> 64" in str(e.value) and "total_steps: 6 -> 8" in str(e.value)
  assert "\n" not in str(e.value) and e.value.exit_code == errors.EXIT_USER
  cfg = tiny_config("ste", steps=8, workdir_cache=data_cache)   # no 'scale' state for STE
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match="scale"):
    loop.train_and_evaluate(cfg, workdir)
  assert _tree_digest(workdir) == before


def _flat(config):
  return {k: v for k, v in traverse_util.flatten_dict(config.to_dict(), sep=".").items()
          if v is not None and not isinstance(v, (tuple, list))}


@pytest.mark.slow
def test_sigkill_before_the_first_periodic_checkpoint_resumes_from_step_0(
    undisturbed, tmp_path, data_cache):
  """A real SIGKILL of launch.py after a logged step but before the first periodic checkpoint
  (run_config checkpoints only at 0 and at the end), then the same command again: it resumes
  from the step-0 checkpoint (Orbax's StepAlreadyExistsError once made this impossible) to
  the undisturbed run's losses, each step once."""
  workdir = str(tmp_path / "killed")
  cmd = [sys.executable, os.path.join(REPO, "launch.py"), "--config",
         os.path.join(REPO, "experiments", "gpt2_s_ste.py") + ":tiny", "--workdir", workdir]
  # the test config, expressed as --config overrides of the experiment file's tiny variant
  want = _flat(run_config(data_cache))
  have = _flat(config_files.load_config(cmd[3]))
  cmd += [f"--config.{k}={v}" for k, v in want.items() if have.get(k) != v]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
  deadline = time.time() + 300
  while not _losses_or_none(workdir) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.02)   # the first log (step 5): training is under way
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL
  killed_at = max(_losses(workdir))
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["0"], "killed too late"
  run = subprocess.run(cmd, env=env, cwd=REPO, timeout=600, capture_output=True, text=True)
  assert run.returncode == 0, run.stderr[-3000:]
  assert losses(workdir) == losses(undisturbed)
  assert_each_step_once(workdir)
  with open(os.path.join(workdir, "metrics.superseded.jsonl")) as f:   # kept, out of the way
    assert killed_at in {json.loads(l)["step"] for l in f}


def _losses_or_none(workdir):
  try:
    return _losses(workdir)
  except (OSError, ValueError):
    return None


@pytest.mark.slow
def test_a_stop_before_or_during_the_first_periodic_save_resumes_from_step_0(
    undisturbed, tmp_path, data_cache):
  """In process: a run that left only the step-0 checkpoint (stop_at_step leaves no final
  checkpoint, as a kill does) resumes from it; one whose step-0 save never completed (a kill
  during it leaves Orbax's temporary directory) starts afresh. Both end with the undisturbed
  run's losses, each step once; the temporary directory is cleaned up."""
  for during_save in (False, True):
    workdir = str(tmp_path / f"during_save_{during_save}")
    loop.train_and_evaluate(run_config(data_cache, stop_at_step=7), workdir)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["0"]
    assert max(losses(workdir)) == 5
    if during_save:   # what a SIGKILL in the middle of the step-0 save leaves
      os.rename(os.path.join(workdir, "checkpoints", "0"),
                os.path.join(workdir, "checkpoints", "0.orbax-checkpoint-tmp"))
    final = loop.train_and_evaluate(run_config(data_cache), workdir)
    assert final["step"] == STEPS
    assert losses(workdir) == losses(undisturbed)
    assert_each_step_once(workdir)
    assert [r["step"] for r in records(workdir)][0] == 0   # the step-0 records, once
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["0", str(STEPS)]


def test_a_signal_during_the_start_up_stops_before_anything_is_written(tmp_path, data_cache,
                                                                       monkeypatch):
  """SIGTERM while the run is being checked (a long token-cache build, say): the run stops
  at once, with exit code 75, before its first write; the rest of the checks never run."""
  if threading.current_thread() is not threading.main_thread():
    pytest.skip("signal handlers are installed from the main thread only")
  def signalled(*args, **kwargs):
    del args, kwargs
    os.kill(os.getpid(), signal.SIGTERM)   # handled by the loop's preemption.Guard
    raise AssertionError("the signal did not stop the checks at once")

  monkeypatch.setattr(validate, "check_run", signalled)
  workdir = tmp_path / "w"
  with pytest.raises(preemption.Preempted, match="before training started; nothing was written"
                     ) as e:
    loop.train_and_evaluate(tiny_config("ste", workdir_cache=data_cache), str(workdir))
  assert e.value.exit_code == errors.EXIT_PREEMPTED and not workdir.exists()


_SAID_CODE = re.compile(r"\(exit code (\d+)\)")


@pytest.mark.slow
@pytest.mark.parametrize("signalled, total, stopped_at, outcome", [
    ("in the last step", 3, None, errors.EXIT_OK),             # finishes, as it says
    ("in the step before the last", 3, 2, errors.EXIT_PREEMPTED),   # stops after that step
    ("while it starts, one step from the end", 1, 1, errors.EXIT_PREEMPTED),  # no check left
])
def test_a_signal_says_the_exit_code_the_run_then_has(signalled, total, stopped_at, outcome,
                                                       tmp_path, data_cache, monkeypatch,
                                                       caplog):
  """SIGINT in the last step said 'stopping (exit code 75)' and the run exited 0. Each
  signal's message names an exit code; the run ends with that one: a stop (75) after saving
  the checkpoint of the step it stopped at, or the run's end (0), its final checkpoint and
  metrics written."""
  if threading.current_thread() is not threading.main_thread():
    pytest.skip("signal handlers are installed from the main thread only")

  def interrupt():
    os.kill(os.getpid(), signal.SIGINT)   # handled by the loop's preemption.Guard

  if signalled.startswith("while it starts"):
    real_create = loop.Run.create.__func__

    def create(cls, *args, **kwargs):
      run = real_create(cls, *args, **kwargs)
      interrupt()   # after the checks (at once: nothing written) and the first writes
      return run
    monkeypatch.setattr(loop.Run, "create", classmethod(create))
  else:
    real_step = loop.Run.train_step
    at = total - 1 if signalled == "in the last step" else total - 2

    def step(self, state, batch, info):
      if int(info.step) == at:
        interrupt()
      return real_step(self, state, batch, info)
    monkeypatch.setattr(loop.Run, "train_step", step)
  workdir = tmp_path / "w"
  cfg = tiny_config("ste", steps=total, workdir_cache=data_cache,
                    overrides={"checkpoint_every": 100, "eval_every": 100})
  with caplog.at_level("WARNING"):
    try:
      final, code = loop.train_and_evaluate(cfg, str(workdir)), errors.EXIT_OK
    except preemption.Preempted as e:
      final, code = None, e.exit_code
  said = [r.getMessage() for r in caplog.records if "SIGINT received" in r.getMessage()]
  assert len(said) == 1, said
  assert [int(c) for c in _SAID_CODE.findall(said[0])] == [outcome] == [code], said
  checkpoints = sorted(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit())
  if outcome == errors.EXIT_OK:
    assert final["step"] == total and checkpoints[-1] == total
    assert (workdir / "final_metrics.json").exists()
  else:
    assert checkpoints[-1] == stopped_at and max(losses(str(workdir))) == stopped_at


@pytest.mark.slow
def test_a_diverged_run_stops_and_keeps_a_finite_checkpoint(tmp_path, data_cache):
  workdir = str(tmp_path / "nan")
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "launch.py"), "--config",
       os.path.join(REPO, "experiments", "gpt2_dense.py") + ":tiny", "--workdir", workdir,
       "--config.optim.lr=1e6", "--config.optim.grad_clip=0", "--config.total_steps=40",
       "--config.checkpoint_every=10", "--config.batch_size=4", "--config.model.seq_len=16",
       "--config.model.num_layers=1", "--config.model.num_heads=2", "--config.model.d_model=32",
       f"--config.data.cache_dir={data_cache}"],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=900)
  assert proc.returncode == errors.EXIT_NON_FINITE, proc.stderr[-3000:]
  msg = [l for l in proc.stderr.splitlines() if "not finite" in l]
  assert msg and "step " in msg[-1] and "last good checkpoint is step" in msg[-1], proc.stderr[-2000:]
  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")))
  assert steps, "a finite checkpoint is kept"
  cfg = tiny_config("dense", workdir_cache=data_cache)
  fresh = RunSpec.build(cfg).fresh_state(0)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
  for step in steps:   # every checkpoint left behind is finite
    ckpt = ckpt_lib.Checkpointer(workdir)
    restored = ckpt.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    ckpt.close()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.params))
  assert not os.path.exists(os.path.join(workdir, "final_metrics.json"))


@pytest.mark.slow
def test_the_loop_passes_each_steps_info_to_the_train_step(tmp_path, data_cache, monkeypatch):
  """log_every=3 over 7 steps: the train step of index i gets StepInfo(step=i, log=...) with
  log True exactly where (i + 1) % 3 == 0 or i is the last index (brute force below), and
  the loss is written at exactly those steps. When a step is dispatched, at most one earlier
  step is still unfinished (the loop waits for the one before it), whatever log_every: so a
  signal stops the run within a step or two."""
  total, log_every = 7, 3
  seen, dispatched, unfinished = [], [], []
  real = loop.Run.train_step   # the step: the executable compiled before the run (fit.py)

  def recording(self, state, batch, info):
    seen.append(info)
    unfinished.append(sum(not m["loss"].is_ready() for m in dispatched))
    out = real(self, state, batch, info)
    dispatched.append(out[1])
    return out

  monkeypatch.setattr(loop.Run, "train_step", recording)
  cfg = tiny_config("ste", steps=total, workdir_cache=data_cache,
                    overrides={"log_every": log_every, "checkpoint_every": 100,
                               "eval_every": 100})
  loop.train_and_evaluate(cfg, str(tmp_path))
  logged = [i for i in range(total) if (i + 1) % log_every == 0 or i == total - 1]
  assert logged == [2, 5, 6]
  assert all(isinstance(info, StepInfo) for info in seen), seen
  assert [int(info.step) for info in seen] == list(range(total))
  assert [i for i, info in enumerate(seen) if bool(info.log)] == logged
  assert sorted(_losses(str(tmp_path))) == [i + 1 for i in logged]
  assert max(unfinished) <= 1, unfinished


@pytest.mark.slow
def test_a_methods_configure_warning_is_logged_once(tmp_path, data_cache):
  """SR-STE with decay_auto and a 2-step warm-up: its controller window [1, 2) holds fewer
  than two rounds, which `configure` warns about. The run is built once (RunSpec), so
  train.log holds the warning once."""
  workdir = str(tmp_path / "sr_ste")
  cmd = [sys.executable, os.path.join(REPO, "launch.py"), "--config",
         os.path.join(REPO, "experiments", "gpt2_sr_ste.py") + ":tiny", "--workdir", workdir,
         "--config.total_steps=2", "--config.optim.warmup_steps=2",
         "--config.sparsity.sr_ste.decay_auto=True", "--config.batch_size=4",
         "--config.model.seq_len=16", "--config.model.num_layers=1",
         "--config.model.num_heads=2", "--config.model.d_model=32", "--config.log_every=1",
         "--config.eval_every=2", "--config.eval_batches=1", "--config.checkpoint_every=2"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", S24JAX_CACHE=data_cache)
  run = subprocess.run(cmd, env=env, cwd=REPO, timeout=600, capture_output=True, text=True)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  with open(os.path.join(workdir, "train.log"), encoding="utf-8") as f:
    lines = [l for l in f if "holds fewer than two rounds" in l]
  assert len(lines) == 1, lines
  assert "sparsity.sr_ste.decay_auto" in lines[0] and "[1, 2)" in lines[0]
  assert os.path.exists(os.path.join(workdir, "final_metrics.json"))
