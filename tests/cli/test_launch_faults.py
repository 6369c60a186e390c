"""launch.py's user mistakes and environment faults (issue 41), each as the command line runs
it: the exit code (README, "Exit codes"), exactly one line naming the flag or file and what it
is, no traceback, and nothing written (tests/faults.py's `snapshot` of the folder, before and
after; a dangling link and its missing target checked by hand, as `snapshot` cannot read
one). In process (launch.main after its flag parsing, as `python launch.py` runs it; these
stop before any training): a run.lock that is a folder or a link, a workdir that is a file, a
dangling link, a link to a file or under a dangling link, a config that is a folder, cluster
flags out of range or malformed; what a failed checkpoint read leaves for a library to ignore
stays off the terminal (the damage has its own line). As subprocesses (slow): --distributed
where no cluster can be found, with and without the lock taken first; a train step that does
not fit the device's memory (the design card's command on a small machine: fit.py's exit 6,
its one line through launch, no workdir created). The lock's own rules:
tests/training/test_workdir.py; the signals: tests/cli/test_launch.py and
tests/training/test_loop.py."""
import io
import logging as std_logging
import os
import signal
import subprocess
import sys
import types

import pytest
from absl import flags
from absl import logging as absl_logging

import launch
from s24jax import errors

from faults import snapshot

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "experiments", "gpt2_s_ste.py") + ":tiny"
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
TINY = ["--config.total_steps=2", "--config.batch_size=4", "--config.model.seq_len=16",
        "--config.model.num_layers=1", "--config.model.num_heads=2", "--config.model.d_model=32"]


@pytest.fixture
def launch_cli(capfd):
  """`python launch.py ARGS` in this process: (exit code, what the terminal shows: s24jax's
  lines and every warning, launch._OnlyOursOrWarnings). The logging, the flags and the signal
  handlers it sets are undone after each call."""
  root = std_logging.getLogger()
  absl_handler = absl_logging.get_absl_handler()
  absl_logger = std_logging.getLogger("absl")

  def run(*argv):
    saved = (root.level, list(root.handlers), sys.unraisablehook, list(absl_handler.filters),
             absl_logger.level, {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)})
    terminal = io.StringIO()
    handler = std_logging.StreamHandler(terminal)
    handler.addFilter(launch._OnlyOursOrWarnings())   # pylint: disable=protected-access
    root.addHandler(handler)
    launch._overrides.clear()   # pylint: disable=protected-access
    try:
      launch.main(launch.parse_flags(["launch.py", "--config", CONFIG, *TINY, *argv]))
      code = 0
    except SystemExit as e:
      code = e.code
    finally:
      for h in root.handlers[:]:
        if h not in saved[1]:
          root.removeHandler(h)
          h.close()
      root.setLevel(saved[0])
      sys.unraisablehook = saved[2]
      absl_handler.filters[:] = saved[3]
      flags.FLAGS.unparse_flags()
      absl_logger.setLevel(saved[4])
      for s, h in saved[5].items():
        signal.signal(s, h)
    out, err = capfd.readouterr()
    return code, terminal.getvalue() + out + err

  yield run


def _one_line(text: str, says: str) -> None:
  lines = [l for l in text.splitlines() if says in l]
  assert len(lines) == 1 and "Traceback" not in text, text[-3000:]


def test_a_run_lock_that_is_not_a_file_is_refused_and_left_as_it_is(tmp_path, launch_cli):
  """The issue's case: run.lock a folder was a traceback (os.remove on a folder). A link
  named run.lock (here to a live lock of another host's run, which must not be followed
  or removed) is not a lock s24jax writes either."""
  folder, linked = tmp_path / "folder", tmp_path / "linked"
  (folder / "run.lock").mkdir(parents=True)
  (folder / "run.lock" / "notes.txt").write_text("mine")
  linked.mkdir()
  (tmp_path / "elsewhere.lock").write_text('{"host": "other", "pid": 7, "started": "now"}')
  os.symlink(tmp_path / "elsewhere.lock", linked / "run.lock")
  before = snapshot(tmp_path)
  for workdir, what in ((folder, "a folder"), (linked, "a symbolic link to ")):
    code, terminal = launch_cli("--workdir", str(workdir))
    assert code == errors.EXIT_USER, terminal
    _one_line(terminal, f"{workdir / 'run.lock'} is {what}")
    assert "not a lock s24jax writes: move it out of the workdir" in terminal, terminal
    assert snapshot(tmp_path) == before


def test_a_workdir_that_is_not_a_folder_says_what_it_is(tmp_path, launch_cli):
  """A file, a link to a file, a dangling link (called a file before: often a disk not
  mounted, whose target must not be created here) and a path under a dangling link."""
  files = tmp_path / "files"
  files.mkdir()
  (files / "a_file").write_text("x")
  os.symlink(files / "a_file", files / "link_to_a_file")
  before = snapshot(files)
  for workdir, says in (
      (files / "a_file", f"--workdir {files / 'a_file'} is a file, not a folder"),
      (files / "link_to_a_file", f"--workdir {files / 'link_to_a_file'} is a symbolic link to "
       f"{files / 'a_file'}, not a folder")):
    code, terminal = launch_cli("--workdir", str(workdir))
    assert code == errors.EXIT_USER, terminal
    _one_line(terminal, says)
    assert snapshot(files) == before
  dangling, target = tmp_path / "dangling", tmp_path / "not_mounted" / "disk"
  os.symlink(target, dangling)
  for workdir, says in (
      (dangling, f"--workdir {dangling} is a symbolic link to {target} (which does not "
       f"exist), not a folder: mount or create {target}, or choose another --workdir"),
      (dangling / "run", f"cannot create the workdir {dangling / 'run'}: {dangling} is a "
       f"symbolic link to {target} (which does not exist)")):
    code, terminal = launch_cli("--workdir", str(workdir))
    assert code == errors.EXIT_USER, terminal
    _one_line(terminal, says)
    assert os.readlink(dangling) == str(target) and not os.path.lexists(target.parent)
    assert sorted(os.listdir(tmp_path)) == ["dangling", "files"]


@pytest.mark.parametrize("flag, says", [
    (["--num_processes=0"], "--num_processes=0: 0 is not a positive integer"),
    (["--process_id=-1"], "--process_id=-1: -1 is not a non-negative integer"),
    (["--num_processes=2", "--process_id=2"], "--process_id must be below --num_processes"),
    (["--coordinator_address=10.0.0.1"], "--coordinator_address must be host:port"),
    (["--coordinator_address=10.0.0.1:0"], "the port in 1-65535"),
    (["--coordinator_address=10.0.0.1:65536"], "the port in 1-65535"),
])
def test_cluster_flags_out_of_range_are_one_line_before_anything(flag, says, tmp_path,
                                                                  launch_cli):
  """--process_id -1 used to skip the lock and write train.process-1.log; 0 processes reached
  jax.distributed.initialize's traceback."""
  code, terminal = launch_cli("--workdir", str(tmp_path / "w"), *flag)
  assert code == errors.EXIT_USER, terminal
  _one_line(terminal, says)
  assert os.listdir(tmp_path) == []


def test_a_config_that_is_a_folder_is_called_a_folder(tmp_path, launch_cli):
  """It was 'not found'."""
  code, terminal = launch_cli("--config", str(tmp_path), "--workdir", str(tmp_path / "w"))
  assert code == errors.EXIT_USER, terminal
  _one_line(terminal, f"config file '{tmp_path}' is a folder")
  assert os.listdir(tmp_path) == []


def _ignored(error_type, message, filename="<test>"):
  """What sys.unraisablehook receives for `error_type(message)` raised in code of
  `filename` (a library's file, as its traceback names it)."""
  try:
    code = compile(f"raise {error_type.__name__}({message!r})", filename, "exec")
    exec(code)   # pylint: disable=exec-used
  except error_type as e:
    return types.SimpleNamespace(exc_type=error_type, exc_value=e, object=None,
                                 exc_traceback=e.__traceback__, err_msg=None)


def test_what_a_failed_checkpoint_read_leaves_ignored_stays_off_the_terminal(monkeypatch):
  """A damaged checkpoint's read leaves Orbax's coroutines closed half-way, each ignored with
  an error holding a TensorStore spec of 50 lines, and tensorstore's callbacks into a closed
  event loop: train.log only (the damage has its own line). Anything else a library ignores:
  one line, its message's first, the first time."""
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  root = std_logging.getLogger()
  terminal, log = io.StringIO(), io.StringIO()
  shown, kept = std_logging.StreamHandler(terminal), std_logging.StreamHandler(log)
  shown.addFilter(launch._OnlyOursOrWarnings())   # pylint: disable=protected-access
  for h in (shown, kept):
    root.addHandler(h)
  try:
    launch._ignored_exceptions_to_the_log()   # pylint: disable=protected-access
    orbax = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "serialization.py")
    sys.unraisablehook(_ignored(RuntimeError, "Event loop is closed"))
    sys.unraisablehook(_ignored(Exception, "Encountered error while reading array index: "
                                "TensorStore({\n  'base': {\n" * 20, orbax))
    assert terminal.getvalue() == "" and log.getvalue().count("exception ignored in") == 2
    sys.unraisablehook(_ignored(ValueError, "first line\nsecond line"))
    sys.unraisablehook(_ignored(ValueError, "another"))
  finally:
    for h in (shown, kept):
      root.removeHandler(h)
  assert terminal.getvalue().splitlines() == [
      "a library ignored an exception (ValueError: first line); it and any later ones are in "
      "train.log"], terminal.getvalue()
  assert log.getvalue().count("exception ignored in") == 4


def _launch(tmp_path, *argv, timeout=300):
  run = subprocess.run([sys.executable, os.path.join(REPO, "launch.py"), "--config", CONFIG,
                        *TINY, *argv], env=ENV, cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
  return run.returncode, run.stdout + run.stderr


@pytest.mark.slow
def test_distributed_without_a_cluster_is_one_line_and_writes_nothing(tmp_path):
  """No coordinator in the flags nor in the environment: jax.distributed.initialize's
  ValueError was a traceback (exit 1). With --process_id 0 the lock is taken first: it and
  the workdir it created are gone again."""
  env_cluster = [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "KUBERNETES_"))]
  if env_cluster:
    pytest.skip(f"a cluster in the environment ({env_cluster[0]})")
  for flags_ in (["--distributed"], ["--num_processes=2", "--process_id=0"]):
    code, out = _launch(tmp_path, "--workdir", str(tmp_path / "runs" / "w"), *flags_)
    assert code == errors.EXIT_USER, out[-3000:]
    _one_line(out, "cannot start the distributed run (")
    assert "--coordinator_address" in out and not (tmp_path / "runs").exists(), out[-3000:]


@pytest.mark.slow
def test_a_step_that_does_not_fit_is_exit_6_in_one_line_through_launch(tmp_path):
  """The design card's command on a machine too small for its step (here the tiny model
  against a memory of 1 MiB, set through fit.py's own figure of the device's memory): fit.py
  stops it before step 1; through launch that is one line naming what the step needs,
  exit code 6, and no workdir."""
  code = ("import sys, runpy; sys.argv = sys.argv[1:]; "
          "from s24jax.training import fit; "
          "fit.device_capacity = lambda dev: (2**20, 'a memory of 1 MiB'); "
          "runpy.run_path(sys.argv[0], run_name='__main__')")
  run = subprocess.run([sys.executable, "-c", code, os.path.join(REPO, "launch.py"),
                        "--config", CONFIG, *TINY, "--workdir", str(tmp_path / "w")],
                       env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
  out = run.stdout + run.stderr
  assert run.returncode == errors.EXIT_DOES_NOT_FIT, out[-3000:]
  _one_line(out, "the train step needs ")
  assert "a memory of 1 MiB" in out and "does not fit" in out, out[-3000:]
  assert "(exit code 6)" in out, out[-3000:]
  assert os.listdir(tmp_path) == []
