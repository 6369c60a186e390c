"""Tests for launch.py (with s24jax/training/preemption.py and the workdir lock it takes), in
subprocesses: a second launch on a held workdir exits 3 naming the holder; SIGTERM saves the
step in flight and exits 75, and the same command then finishes with an undisturbed run's
losses at every logged step, bit for bit (the reference: the same config trained in process
without interruption), each step written once; explicit cluster flags imply --distributed;
bad inputs (a value, a pattern, a checkpoint of another config, a flag) exit 2 with one line
naming it, no traceback, a new workdir not created and an existing one unchanged byte for
byte; Ctrl-C while it imports its libraries is one line (exit 75). In process: an internal
error keeps its traceback, on the terminal and in train.log (exit 1); a user error writes no
log; a library's traceback stays off the terminal; the last line names the step as an
integer. Every fault of the places it writes: tests/cli/test_write_paths.py."""
import logging as std_logging
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest
from absl import logging
from flax import traverse_util

import launch
from s24jax.training import checkpoint as ckpt_lib
from s24jax import config_files
from s24jax import errors
from s24jax.training import loop
from s24jax.training import preemption
from s24jax.training import validate
from s24jax.training import workdir as workdir_lib

from train_helpers import STEPS, assert_each_step_once, digest, losses, run_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
  # The first run is frozen while the second starts (its start-up can outlast a whole tiny run
  # on a loaded machine), so the SIGTERM below still finds it training.
  os.kill(proc.pid, signal.SIGSTOP)
  try:
    second = subprocess.run(cmd, env=ENV, cwd=REPO, timeout=300, capture_output=True, text=True)
  finally:
    os.kill(proc.pid, signal.SIGCONT)
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


@pytest.fixture
def launch_logging():
  """launch.py's log set-up in this process (under app.run: absl's handler on the root
  logger, the terminal), undone afterwards."""
  root = std_logging.getLogger()
  level, handler = root.level, logging.get_absl_handler()
  filters, attached = list(handler.filters), handler in root.handlers
  root.addHandler(handler)
  held = launch._terminal_logs()   # pylint: disable=protected-access
  yield held
  root.setLevel(level)
  handler.filters[:] = filters
  if not attached:
    root.removeHandler(handler)
  for h in list(root.handlers):
    if isinstance(h, std_logging.FileHandler):
      root.removeHandler(h)
      h.close()


def _record(path, level, exc_info=None):
  return std_logging.LogRecord("absl", level, path, 1, "message", (), exc_info)


def test_the_terminal_keeps_ours_and_library_warnings_without_tracebacks():
  keep = launch._OnlyOursOrWarnings()   # pylint: disable=protected-access
  ours = os.path.join(REPO, "s24jax", "loop.py")
  orbax = "/site-packages/orbax/checkpoint/checkpoint_manager.py"
  try:
    raise OSError(28, "No space left on device")
  except OSError:
    exc = sys.exc_info()
  assert keep.filter(_record(ours, std_logging.INFO))
  assert keep.filter(_record(ours, std_logging.ERROR, exc))
  assert not keep.filter(_record(orbax, std_logging.INFO))
  assert keep.filter(_record(orbax, std_logging.WARNING))
  assert not keep.filter(_record(orbax, std_logging.ERROR, exc))   # train.log only


def test_a_train_log_that_cannot_be_written_is_said_once(tmp_path, capsys):
  """A full disk under the workdir: one line on the terminal, not a '--- Logging error ---'
  traceback per record."""
  handler = launch._LogFile(str(tmp_path / "train.log"))   # pylint: disable=protected-access

  class Full:
    def write(self, text):
      raise OSError(28, "No space left on device")

    def flush(self):
      pass

  handler.stream = Full()
  for _ in range(3):
    handler.handle(_record(os.path.join(REPO, "s24jax", "loop.py"), std_logging.INFO))
  err = capsys.readouterr().err
  assert err.count("cannot write") == 1 and "No space left on device" in err, err
  assert "Logging error" not in err and "Traceback" not in err


def test_launch_an_internal_error_keeps_its_traceback_in_train_log(tmp_path, launch_logging,
                                                                    monkeypatch, capsys):
  workdir = str(tmp_path / "w")

  def crashing(config, workdir, *, on_start, allow_unmatched_layers, source=""):
    del config, workdir, allow_unmatched_layers
    on_start()
    raise RuntimeError("an internal failure")

  monkeypatch.setattr(loop, "train_and_evaluate", crashing)
  os.makedirs(workdir)
  code = launch._train(None, workdir, False, launch_logging)   # pylint: disable=protected-access
  assert code == errors.EXIT_CRASH
  with open(os.path.join(workdir, "train.log"), encoding="utf-8") as f:
    log = f.read()
  assert "Traceback" in log and "RuntimeError: an internal failure" in log
  assert "RuntimeError: an internal failure" in capsys.readouterr().err   # and the terminal


def test_launch_a_user_error_writes_no_log(tmp_path, launch_logging, monkeypatch):
  workdir = str(tmp_path / "w")
  os.makedirs(workdir)

  def refusing(config, workdir, *, on_start, allow_unmatched_layers, source=""):
    del config, workdir, on_start, allow_unmatched_layers
    logging.info("held until the checks pass")
    raise errors.UserError("config.optim.lr=-1: must be > 0")

  monkeypatch.setattr(loop, "train_and_evaluate", refusing)
  code = launch._train(None, workdir, False, launch_logging)   # pylint: disable=protected-access
  assert code == errors.EXIT_USER
  assert os.listdir(workdir) == []
  assert launch_logging not in std_logging.getLogger().handlers


# ---------------------------------------------------------------------------------------------
# launch.py as a subprocess: the command line itself.

TINY = ["--config.batch_size=4", "--config.model.seq_len=16", "--config.model.num_layers=1",
        "--config.model.num_heads=2", "--config.model.d_model=32"]


@pytest.mark.slow
def test_launch_bad_inputs_exit_2_in_one_line_and_leave_the_workdir_as_it_was(
    tmp_path, data_cache):
  base = os.path.join(REPO, "experiments", "gpt2_ste.py") + ":tiny"
  args = TINY + [f"--config.data.cache_dir={data_cache}"]
  # A workdir as this command leaves it at its start: config.json, the step-0 checkpoint.
  existing = str(tmp_path / "existing")
  config = validate.load_config(base, args=[a.split(".", 1)[1] for a in args])
  ckpt = ckpt_lib.Checkpointer(existing)
  ckpt.save(0, jax.jit(validate.check_config(config).fresh_state)(), force=True)
  ckpt.close()
  workdir_lib.write_config(existing, config, 0)
  new = str(tmp_path / "runs" / "new")
  cases = [   # (workdir, extra arguments, what the one line names)
      (new, ["--config.optim.lr=-1e-3"], "config.optim.lr=-0.001"),
      (new, ["--config.sparsity.sparse_layers=('*/nothing/*',)"], "['*/nothing/*']"),
      (existing, ["--config.model.d_model=64"], "model.d_model: 32 -> 64"),
      (existing, ["--workdri=x"], "Unknown command line flag 'workdri'"),
  ]
  before = digest(existing)
  for workdir, extra, named in cases:
    run = subprocess.run([sys.executable, os.path.join(REPO, "launch.py"), "--config", base,
                          "--workdir", workdir, *args, *extra], env=ENV, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == errors.EXIT_USER, (extra, out[-3000:])
    assert "Traceback" not in out and named in out, (extra, out[-3000:])
    lines = [l for l in out.splitlines() if named in l]
    assert len(lines) == 1, lines
    assert not os.path.exists(tmp_path / "runs")
    assert digest(existing) == before, extra


def test_the_last_line_names_the_step_as_an_integer():
  """A finished run read back from final_metrics.json holds its step as a float (it said
  "done at step 4.0"); a run stopped by stop_at_step has no finals (it said "done at step
  None", with nan losses)."""
  config = config_files.load_config(os.path.join(REPO, "experiments", "gpt2_ste.py") + ":tiny",
                                    {"stop_at_step": 2})
  final = {"step": 4.0, "train/loss": 10.80651, "val/loss": 10.7331, "data/unigram_entropy": 6.4178}
  assert launch.done_line(final, config) == ("done at step 4: train loss 10.8065, val loss "
                                             "10.7331 (unigram entropy 6.418)")
  assert launch.done_line({"data/unigram_entropy": 6.4178}, config) == (
      "stopped at step 2 (config.stop_at_step): nothing logged yet (unigram entropy 6.418)")
  assert launch.done_line({"train/loss": 9.0}, config) == (
      "stopped at step 2 (config.stop_at_step): train loss 9.0000")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc to see the imports")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_while_importing_is_one_line(signum, tmp_path):
  """SIGINT while launch.py imports its libraries (seconds; much of it in C extensions, where
  a KeyboardInterrupt became a traceback, an ImportError or a crash): one line, exit 75,
  nothing written; and SIGTERM (a job cancelled as it starts: it was killed without a word).
  The signal is sent once jaxlib is loaded, so within the imports."""
  workdir = tmp_path / "w"
  proc = subprocess.Popen([sys.executable, os.path.join(REPO, "launch.py"), "--config",
                           os.path.join(REPO, "experiments", "gpt2_ste.py") + ":tiny",
                           "--workdir", str(workdir)], env=ENV, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 120
  while proc.poll() is None and time.time() < deadline:
    with open(f"/proc/{proc.pid}/maps", encoding="utf-8", errors="replace") as f:
      if "jaxlib" in f.read():
        break
    time.sleep(0.01)
  proc.send_signal(signum)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == errors.EXIT_PREEMPTED, out[-3000:]
  assert out.strip() == (f"launch.py: stopped by {signum.name} while starting; nothing was "
                         "written. Run "
                         f"it again (exit code {errors.EXIT_PREEMPTED})"), out[-3000:]
  assert not workdir.exists()
