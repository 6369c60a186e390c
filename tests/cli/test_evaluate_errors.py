"""`python -m s24jax.cli.evaluate` on bad input (issue 41): every mistake is one line and exit
code 2, found before any work (the tasks are not loaded, the checkpoint is not read: both are
replaced here by a function that fails the test), nothing written. Run as the command line
runs it (`evaluate.main` in this process); the write faults: tests/cli/test_write_paths.py."""
from __future__ import annotations

import json
import os
import types

import jax
import pytest

from s24jax import errors
from s24jax.cli import evaluate
from s24jax.data import olmo_tasks
from s24jax.training import platform_dtypes
from s24jax.training import trained as trained_lib

from faults import snapshot


def _one_line(err: str, says: str) -> None:
  assert err.count("\n") == 1 and says in err and "Traceback" not in err, err
  assert err.startswith("s24jax.cli.evaluate: "), err


@pytest.fixture
def run(tmp_path, monkeypatch):
  """A folder laid out as a run's workdir (checks are path-based: no checkpoint is read), with
  the work replaced by a failure."""
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "24").mkdir(parents=True)
  (workdir / "config.json").write_text("{}")

  def no_work(*a, **k):
    raise AssertionError("the work started before the arguments were checked")
  monkeypatch.setattr(trained_lib, "load_run", no_work)
  monkeypatch.setattr(olmo_tasks, "load_task", no_work)
  return workdir


def test_bad_arguments_are_one_line_and_exit_code_2(run, tmp_path, capsys):
  (tmp_path / "a_file").write_text("mine")
  (tmp_path / "dangling").symlink_to(tmp_path / "unmounted")
  # (snapshot reads every file: a dangling link is looked at by name)
  before = snapshot(run), sorted(os.listdir(tmp_path)), (tmp_path / "a_file").read_text()
  ok = ["--workdir", str(run), "--tasks", "piqa"]
  for argv, says in (
      (["--workdir", str(tmp_path / "a_file"), "--tasks", "piqa"],
       f"argument --workdir: {tmp_path / 'a_file'} is a file, not a run's workdir"),
      (["--workdir", str(tmp_path / "dangling"), "--tasks", "piqa"],
       f"{tmp_path / 'dangling'} is a symbolic link to {tmp_path / 'unmounted'}, which does "
       "not exist"),
      (["--workdir", str(tmp_path / "none"), "--tasks", "piqa"], "none does not exist"),
      ([*ok, "--batch_tokens", "-5"], "argument --batch_tokens: -5 is below the minimum, 0"),
      ([*ok, "--step", "-1"], "argument --step: -1 is below the minimum, 0"),
      ([*ok, "--step", "2.5"], "argument --step: '2.5' is not an integer"),
      ([*ok, "--limit", "0"], "argument --limit: 0 is below the minimum, 1"),
      ([*ok, "--dtype", "foo"], "argument --dtype: invalid choice: 'foo'"),
      (["--workdir", str(run), "--tasks", " , "], "argument --tasks: names no task"),
      (["--workdir", str(run), "--tasks", f"piqa,{tmp_path}"],
       f"argument --tasks: {tmp_path} is a folder, not a requests file"),
      (["--workdir", str(run), "--tasks", str(tmp_path / "dangling")],
       f"argument --tasks: {tmp_path / 'dangling'} is a symbolic link to")):
    with pytest.raises(SystemExit) as stop:
      evaluate.main(argv)
    assert stop.value.code == errors.EXIT_USER, argv
    _one_line(capsys.readouterr().err, says)
    assert (snapshot(run), sorted(os.listdir(tmp_path)), (tmp_path / "a_file").read_text()) \
        == before, argv


def test_the_report_is_never_one_of_the_runs_own_entries(run, tmp_path, capsys):
  """--json inside checkpoints/ (a save prunes what it does not know there) or on a file the
  run writes later (pending_metrics.json, not there yet): refused before any work."""
  before = snapshot(tmp_path)
  for where, says in ((run / "checkpoints" / "r.json", "in the run's checkpoints/"),
                      (run / "checkpoints" / "24" / "r.json", "in the run's checkpoints/"),
                      (run / "tensorboard" / "r.json", "in the run's tensorboard/"),
                      (run / "pending_metrics.json", "the run's pending_metrics.json")):
    code = evaluate.main(["--workdir", str(run), "--tasks", "piqa", "--json", str(where)])
    assert code == errors.EXIT_USER, where
    _one_line(capsys.readouterr().err, f"--json {where} is {says}")
    assert snapshot(tmp_path) == before, where
  # A report beside the run's entries passes these checks and goes on to the work (here: the
  # fixture's failure, a bug's traceback and exit code 1).
  code = evaluate.main(["--workdir", str(run), "--tasks", "piqa", "--json", str(run / "r.json")])
  assert code == errors.EXIT_CRASH and "the work started" in capsys.readouterr().err


def test_a_dtype_this_device_cannot_compute_in(run, tmp_path, capsys):
  platform = jax.devices()[0].platform
  if platform_dtypes.problem("float16", platform) is None:
    pytest.skip(f"this jax computes float16 on {platform}: nothing to refuse")
  before = snapshot(tmp_path)
  code = evaluate.main(["--workdir", str(run), "--tasks", "piqa", "--dtype", "float16"])
  assert code == errors.EXIT_USER
  err = capsys.readouterr().err
  _one_line(err, f"--dtype='float16': the {platform} device cannot train in float16")
  assert "float32" in err.split("dtypes that work here:")[1] and "config.model" not in err
  assert snapshot(tmp_path) == before


def test_a_file_put_at_json_during_the_work_is_left_alone(tmp_path, monkeypatch, capsys):
  """The report's guard holds at the write too: a user's file that appeared at --json while
  the scores were computed is not replaced (one line, exit code 2, the scores printed)."""
  workdir, path = tmp_path / "run", tmp_path / "report.json"
  workdir.mkdir()
  monkeypatch.setattr(olmo_tasks, "load_task", lambda *a, **k: None)
  monkeypatch.setattr(trained_lib, "load_run",
                      lambda *a: types.SimpleNamespace(workdir=str(workdir), step=3))

  def scores_meanwhile_a_file_appears(*a, **k):
    path.write_text("my notes")
    return {"workdir": str(workdir), "step": 3, "model": "m", "weights": "w", "tasks": {}}
  monkeypatch.setattr(evaluate, "evaluate", scores_meanwhile_a_file_appears)
  code = evaluate.main(["--workdir", str(workdir), "--tasks", "piqa", "--json", str(path)])
  out, err = capsys.readouterr()
  assert code == errors.EXIT_USER and "| task | docs |" in out
  _one_line(err, "exists and is not an evaluation report: it is left as it is")
  assert path.read_text() == "my notes" and sorted(os.listdir(tmp_path)) == ["report.json", "run"]
  # An earlier report there is replaced.
  path.write_text(json.dumps({"definitions": {}, "tasks": {}}))
  monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: {
      "workdir": str(workdir), "step": 3, "model": "m", "weights": "w", "tasks": {}})
  assert evaluate.main(["--workdir", str(workdir), "--tasks", "piqa", "--json", str(path)]) == 0
  assert json.loads(path.read_text())["step"] == 3
