"""Every command against the faults of the places it writes (s24jax/destinations.py): a
read-only folder, a full disk (at the start, and during the work), a file where a folder
should be, the destination inside or equal to the source, a torn file, a lock left by a dead
process. One table per command, each case run as the command line runs it (its `main` in
this process), checking the exit code (README, "Exit codes"), the one line that says what is
wrong and what to do, no traceback, and every file before and after (tests/faults.py:
`snapshot`, the sha256 of each file). The faults are simulated at Python's file-system entry
points (tests/faults.py says why and what that cannot reach).

Commands: launch.py (the notebook's `loop.train_and_evaluate` is the same path behind it;
and a preempted run's pending metrics), `python -m s24jax.cli.evaluate`, `.export`, `.plan` (its
checks, before the compile plugin, and its write after a compile whose report the test
gives), the comparison scripts' table.md (`compare.script_main`, its runs stubbed);
`python -m s24jax.cli.flops` writes nothing (its config errors: tests/test_errors.py). Runs are
copies of the session's trained run (tests/conftest.py `undisturbed`): a finished run,
restored, never trained again here."""
from __future__ import annotations

import io
import json
import logging as std_logging
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from absl import flags
from absl import logging as absl_logging
from flax import traverse_util
from safetensors import SafetensorError

import launch
from s24jax.cli import compare
from s24jax import config_files
from s24jax import errors
from s24jax.cli import evaluate
from s24jax.cli import export
from s24jax.perf import plan
from s24jax.training import preemption
from s24jax.training import trained as trained_lib
from s24jax.kernels import aot

from faults import Faults, snapshot
from train_helpers import STEPS, run_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERIMENT = os.path.join(REPO, "experiments", "gpt2_s_ste.py") + ":tiny"
RUN_FILES = ("checkpoints", "config.json", "metrics.jsonl", "final_metrics.json")


def _run_files(snap: dict[str, str]) -> dict[str, str]:
  """What a run keeps that a rerun of a finished run must not change (its train.log and a
  TensorBoard event file are appended to by every start)."""
  return {k: v for k, v in snap.items() if k.split(os.sep)[0] in RUN_FILES}


def _one_line(text: str, says: str) -> None:
  lines = [l for l in text.splitlines() if says in l]
  assert len(lines) == 1 and "Traceback" not in text, text[-3000:]


@pytest.fixture
def finished(undisturbed, tmp_path):
  """A copy of the session's finished run, in a folder of its own."""
  def copy(name="run"):
    path = tmp_path / name
    shutil.copytree(undisturbed, path)
    return path
  return copy


# ---------------------------------------------------------------------------------------------
# launch.py


def _launch_argv(workdir, data_cache, *extra):
  """launch.py's command line for the session's run (tests/train_helpers.run_config)."""
  def flat(config):
    return {k: v for k, v in traverse_util.flatten_dict(config.to_dict(), sep=".").items()
            if v is not None and not isinstance(v, (tuple, list))}

  have = flat(config_files.load_config(EXPERIMENT))
  overrides = [f"--config.{k}={v}" for k, v in flat(run_config(data_cache)).items()
               if have.get(k) != v]
  return ["launch.py", "--config", EXPERIMENT, "--workdir", str(workdir), *overrides, *extra]


@pytest.fixture
def launch_main(data_cache, capfd):
  """launch.py's main in this process, as `python launch.py ...` runs it: (exit code, what the
  terminal shows: s24jax's lines and every warning, launch._OnlyOursOrWarnings)."""
  root = std_logging.getLogger()
  absl_handler = absl_logging.get_absl_handler()
  absl_logger = std_logging.getLogger("absl")
  saved = (root.level, list(root.handlers), sys.unraisablehook, list(absl_handler.filters),
           absl_logger.level)

  def run(workdir, *extra):
    terminal = io.StringIO()
    handler = std_logging.StreamHandler(terminal)
    handler.addFilter(launch._OnlyOursOrWarnings())   # pylint: disable=protected-access
    root.addHandler(handler)
    launch._overrides.clear()   # pylint: disable=protected-access
    try:
      launch.main(launch.parse_flags(_launch_argv(workdir, data_cache, *extra)))
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
      flags.FLAGS.unparse_flags()   # absl logs differently once flags are parsed
      absl_logger.setLevel(saved[4])  # (and unparsing sets its logger's level)
    out, err = capfd.readouterr()
    return code, terminal.getvalue() + out + err

  yield run


def test_launch_write_faults(finished, launch_main, tmp_path, monkeypatch):
  # A new workdir in a read-only folder; a finished run on a read-only or full disk: the lock,
  # the first write, is refused; nothing changes, and once the disk is fixed the run is free.
  folder = tmp_path / "readonly"
  folder.mkdir()
  run = finished()
  before = snapshot(tmp_path)
  for fault, workdir, says in (("readonly", folder / "w", "cannot create the workdir"),
                               ("readonly", run, "the filesystem is read-only"),
                               ("full", run, "no space left on the device")):
    with monkeypatch.context() as m:
      getattr(Faults(m), fault)(folder if workdir != run else run)
      code, terminal = launch_main(workdir)
    assert code == errors.EXIT_USER, terminal
    _one_line(terminal, says)
    assert snapshot(tmp_path) == before, fault
  before_run = snapshot(run)
  code, terminal = launch_main(run)   # the disk fixed: the run reports its finals
  assert code == 0 and f"done at step {STEPS}:" in terminal, terminal
  assert _run_files(snapshot(run)) == _run_files(before_run)

  # A file where a folder should be: the workdir itself, or its checkpoints (the case:
  # metrics.jsonl was moved aside before the error); a torn line in the middle of the log; a
  # new run pointed at a workdir instead of an export: refused before anything is written.
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  blocked = finished("blocked")
  shutil.rmtree(blocked / "checkpoints")
  (blocked / "checkpoints").write_text("not a folder")
  damaged = finished("damaged")
  lines = (damaged / "metrics.jsonl").read_text().splitlines(True)
  (damaged / "metrics.jsonl").write_text("".join(lines[:2] + ['{"step": 3, "tr\n'] + lines[2:]))
  before = snapshot(tmp_path)
  for workdir, extra, says in (
      (a_file / "w", (), f"{a_file} is a file, not a folder"),
      (blocked, (), f"{blocked / 'checkpoints'} is a file, but the run keeps a folder there"),
      (damaged, (), "metrics.jsonl, line 3: not a metrics record"),
      (tmp_path / "new", (f"--config.init_from={run}",), "export it first: python -m "
       f"s24jax.cli.export --workdir {run} --out {run / 'hf'}")):
    code, terminal = launch_main(workdir, *extra)
    assert code == errors.EXIT_USER, terminal
    _one_line(terminal, says)
    assert snapshot(tmp_path) == before, workdir

  # A torn last line and a lock left by a dead process (or an empty one, what a full disk left
  # before the lock was written whole, or `{}`, no whole lock either): the run goes on, says
  # so, and loses nothing.
  metrics = (run / "metrics.jsonl").read_bytes()
  (run / "metrics.jsonl").write_bytes(metrics + b'{"step": 25, "train/lo')
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  for lock, says in ((json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                  "started": "earlier"}), f"(pid {dead.pid} on "),
                     ("", "it is not a lock s24jax writes (0 bytes"),
                     ("{}", "it is not a lock s24jax writes (2 bytes")):   # it blocked the run
    (run / "run.lock").write_text(lock)
    code, terminal = launch_main(run)
    assert code == 0, terminal
    _one_line(terminal, f"taking over {run / 'run.lock'}: ")
    assert says in terminal and f"done at step {STEPS}:" in terminal, terminal
    assert not (run / "run.lock").exists()
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert _run_files(snapshot(run)) == _run_files(before_run)
  assert (run / "metrics.jsonl.torn").read_text() == '{"step": 25, "train/lo\n'

  # The folder made read-only after the checks (a remount, a quota): exit 5, one line, the
  # run's files intact.
  def read_only_from_now_on(original):
    def route_logs(*args, **kwargs):
      path = original(*args, **kwargs)
      Faults(monkeypatch).readonly(run)
      return path
    return route_logs
  original = launch._route_logs   # pylint: disable=protected-access
  monkeypatch.setattr(launch, "_route_logs", read_only_from_now_on(original))
  code, terminal = launch_main(run)
  assert code == errors.EXIT_STORAGE, terminal
  _one_line(terminal, f"cannot write the run's files in {run}")
  assert "the filesystem is read-only" in terminal and "checkpoints already complete" in terminal
  _one_line(terminal, f"cannot remove {run / 'run.lock'} (the filesystem is read-only)")
  assert _run_files(snapshot(run)) == _run_files(before_run)


def test_a_preempted_runs_pending_metrics_on_a_full_disk(tmp_path, monkeypatch):
  """The metrics a SIGTERM stop keeps (preemption.save_pending) on a disk that fills midway:
  the earlier file whole, no temporary left."""
  preemption.save_pending(str(tmp_path), 10, [{"train/loss": np.float32(1.5)}])
  before = snapshot(tmp_path)
  with monkeypatch.context() as m:
    Faults(m).full(tmp_path, free_bytes=20)   # part of the new file fits
    with pytest.raises(OSError) as e:
      preemption.save_pending(str(tmp_path), 20, [{"train/loss": np.float32(2.5)}] * 3)
  assert "No space left" in str(e.value) and snapshot(tmp_path) == before
  [pending] = preemption.load_pending(str(tmp_path), 10)
  assert pending["train/loss"].dtype == np.float32 and pending["train/loss"] == 1.5


# ---------------------------------------------------------------------------------------------
# python -m s24jax.cli.evaluate


def _requests(path) -> str:
  """A two-choice task of three documents, in OLMo's request format."""
  lines = [json.dumps({"request_type": "loglikelihood", "doc_id": d, "idx": i, "label": 0,
                       "request": {"context": f"Question {d}: is it?", "continuation": c}})
           for d in range(3) for i, c in enumerate((" yes", " no"))]
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_evaluate_write_faults(undisturbed, finished, tmp_path, monkeypatch, capsys):
  tasks = _requests(tmp_path / "requests.jsonl")
  out = tmp_path / "out"
  out.mkdir()
  (out / "a_folder").mkdir()
  (out / "a_file").write_text("mine")
  run = finished()
  args = ["--workdir", undisturbed, "--tasks", tasks, "--no_progress"]
  before = snapshot(tmp_path)

  def not_before_the_checks(*a, **k):
    raise AssertionError("the checkpoint was read before the report's path was checked")

  for fault, extra, says in (
      ("readonly", ["--json", str(out / "r" / "report.json")], "the filesystem is read-only"),
      ("full", ["--json", str(out / "report.json")], "no space left on the device"),
      (None, ["--json", str(out / "a_folder")], f"--json {out / 'a_folder'} is a folder"),
      (None, ["--json", str(out / "a_file" / "r.json")], f"{out / 'a_file'} is a file"),
      (None, ["--json", str(out / "a_file")], "exists and is not an evaluation report"),
      (None, ["--json", str(run / "config.json")], "exists and is not an evaluation report"),
      ("readonly", ["--workdir", str(run)], "cannot write the evaluation report in")):
    with monkeypatch.context() as m:
      if fault:
        getattr(Faults(m), fault)(run if "--workdir" in extra else out)
      m.setattr(trained_lib, "load_run", not_before_the_checks)
      code = evaluate.main(args + extra)
    err = capsys.readouterr().err
    assert code == errors.EXIT_USER and err.startswith("s24jax.cli.evaluate: "), err
    _one_line(err, says)
    assert snapshot(tmp_path) == before, extra

  # The disk fills during the work: the table is printed, the earlier report stays whole.
  report = out / "report.json"
  assert evaluate.main(args + ["--json", str(report)]) == 0
  printed, earlier = capsys.readouterr().out, report.read_bytes()
  assert "| task | docs |" in printed and json.loads(earlier)["step"] == STEPS
  with monkeypatch.context() as m:
    Faults(m).full(out, ops=("fsync",))
    code = evaluate.main(args + ["--json", str(report)])
  captured = capsys.readouterr()
  assert code == errors.EXIT_STORAGE, captured.err
  assert captured.out == printed.replace(f"wrote {report}\n", "")   # the same table
  _one_line(captured.err, f"cannot write the report {report}")
  assert "the table above holds the scores" in captured.err.lower()
  assert report.read_bytes() == earlier and sorted(os.listdir(out)) == sorted(
      ["a_folder", "a_file", "report.json"])


# ---------------------------------------------------------------------------------------------
# python -m s24jax.cli.export


def test_export_write_faults(finished, tmp_path, monkeypatch, capsys):
  run = finished()
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("keep")
  (tmp_path / "a_file").write_text("x")
  before = snapshot(tmp_path)
  for fault, out, says in (
      (None, run, f"--out {run} is the run's workdir"),
      (None, tmp_path, f"--out {tmp_path} holds the run's workdir {run}"),
      (None, run / "checkpoints", "is inside the run's checkpoints/ folder"),
      (None, run / "checkpoints" / str(STEPS), "is inside the run's checkpoints/ folder"),
      (None, mine, f"--out {mine} is not an earlier export"),
      (None, tmp_path / "a_file", f"--out {tmp_path / 'a_file'} is a file"),
      (None, tmp_path / "a_file" / "hf", f"{tmp_path / 'a_file'} is a file, not a folder"),
      ("readonly", tmp_path / "new" / "hf", "the filesystem is read-only"),
      ("full", tmp_path / "new" / "hf", "no space left on the device")):
    with monkeypatch.context() as m:
      if fault:
        getattr(Faults(m), fault)(tmp_path)
      code = export.main(["--workdir", str(run), "--out", str(out), "--overwrite"])
    err = capsys.readouterr().err
    assert code == errors.EXIT_USER and err.startswith("s24jax.cli.export: "), err
    _one_line(err, says)
    assert snapshot(tmp_path) == before, out

  # An export inside the workdir (the README's --out runs/demo/hf), then the disk fills while
  # it is written again: one line, the earlier export intact, nothing left over.
  out = run / "hf"
  assert export.main(["--workdir", str(run), "--out", str(out)]) == 0
  capsys.readouterr()
  earlier = snapshot(run)

  def disk_full(state, path, metadata=None):
    del state, metadata
    with open(path, "wb") as f:
      f.write(b"\0" * 1000)   # part of the file, then the disk is full
    raise SafetensorError("Error while serializing: I/O error: No space left on device "
                          "(os error 28)")

  monkeypatch.setattr(export.safetensors_np, "save_file", disk_full)
  code = export.main(["--workdir", str(run), "--out", str(out), "--overwrite"])
  err = capsys.readouterr().err
  assert code == errors.EXIT_STORAGE, err
  _one_line(err, f"cannot write the export {out}")
  assert "no space left on the device" in err and "The earlier export there is intact" in err
  assert snapshot(run) == earlier


# ---------------------------------------------------------------------------------------------
# python -m s24jax.perf.plan


def test_plan_checks_its_report_path_before_compiling(tmp_path, monkeypatch, capsys):
  def no_compile():
    raise AssertionError("the report's path must be checked before the compile plugin")

  monkeypatch.setattr(aot, "start", no_compile)
  (tmp_path / "a_folder").mkdir()
  (tmp_path / "notes.json").write_text('{"mine": 1}')
  before = snapshot(tmp_path)
  for fault, path, says in (
      ("readonly", tmp_path / "plan.json", "the filesystem is read-only"),
      ("full", tmp_path / "plan.json", "no space left on the device"),
      (None, tmp_path / "a_folder", "is a folder"),
      (None, tmp_path / "notes.json", "exists and is not a plan report"),
      (None, tmp_path / "notes.json" / "plan.json", "notes.json is a file, not a folder")):
    with monkeypatch.context() as m:
      if fault:
        getattr(Faults(m), fault)(tmp_path)
      try:
        code = plan.main(["--config", EXPERIMENT, "--json", str(path)])
      except SystemExit as e:   # --json's check is an argument's (command.Parser: one line)
        code = e.code
    err = capsys.readouterr().err
    assert code == errors.EXIT_USER and err.startswith("s24jax.perf.plan: "), err
    _one_line(err, says)
    assert snapshot(tmp_path) == before, path

  # After the compile (its report given here: the write path is what is tested), the disk
  # fills: the report is printed, the earlier one at --json stays whole.
  report = {"fits": True, "gpu": "h100", "earlier": False}
  monkeypatch.setattr(aot, "start", lambda: None)
  monkeypatch.setattr(plan, "plan", lambda *a, **k: dict(report))
  monkeypatch.setattr(plan, "format_report", lambda r: f"the report: fits={r['fits']}")
  path = tmp_path / "plan.json"
  path.write_text(json.dumps({**report, "earlier": True}))
  earlier = path.read_bytes()
  with monkeypatch.context() as m:
    Faults(m).full(tmp_path, ops=("fsync",))
    code = plan.main(["--config", EXPERIMENT, "--json", str(path)])
  captured = capsys.readouterr()
  assert code == errors.EXIT_STORAGE and captured.out == "the report: fits=True\n", captured
  _one_line(captured.err, f"cannot write the plan report {path}")
  assert path.read_bytes() == earlier
  assert plan.main(["--config", EXPERIMENT, "--json", str(path)]) == 0   # the disk freed
  assert json.loads(path.read_text())["earlier"] is False


# ---------------------------------------------------------------------------------------------
# experiments/compare_*.py (compare.script_main): ROOT/table.md


def test_compare_replaces_only_its_own_table(tmp_path, monkeypatch, capsys):
  arm = compare.Arm("dense", "experiments/gpt2_dense.py:tiny")
  table = compare.markdown_table([(arm, dict.fromkeys(
      ("val_loss", "train_loss", "unigram", "flip_end", "flip_peak", "tok_s", "wall_s"), 1.0))])

  def script(root, *extra):
    try:
      compare.script_main("a comparison", [arm], "unused", argv=["--root", str(root), *extra])
      code = 0
    except SystemExit as e:
      code = e.code
    return code, capsys.readouterr()

  def no_runs(*a, **k):
    raise AssertionError("a run started before ROOT/table.md was checked")

  users, folder, a_file = tmp_path / "users", tmp_path / "folder", tmp_path / "a_file"
  users.mkdir()
  (users / "table.md").write_text("# my notes on the runs\n")
  (folder / "table.md").mkdir(parents=True)
  a_file.write_text("x")
  new = tmp_path / "new"
  before = snapshot(tmp_path)
  for fault, root, extra, says in (
      (None, users, (), f"--root {users / 'table.md'} exists and is not a comparison table"),
      (None, folder, (), f"{folder / 'table.md'} is a folder, not a comparison table"),
      (None, a_file / "r", (), f"{a_file} is a file, not a folder"),
      ("readonly", new, (), "the filesystem is read-only"),
      ("full", new, (), "no space left on the device"),
      (None, new, ("--only", "sparse"), "--only: unknown runs ['sparse']; valid: dense")):
    with monkeypatch.context() as m:
      if fault:
        getattr(Faults(m), fault)(tmp_path)
      m.setattr(compare, "run_all", no_runs)
      code, out = script(root, *extra)
    assert code == errors.EXIT_USER and out.out == "", out
    _one_line(out.err, says)
    assert out.err.count("\n") == 1 and snapshot(tmp_path) == before, root

  # An earlier table of this command is replaced; then the disk fills during the runs: the
  # table is printed, one line, exit 5, the earlier table whole.
  (new / "table.md").parent.mkdir()
  (new / "table.md").write_text(table.replace("1.000", "2.000") + "\n")
  monkeypatch.setattr(compare, "run_all", lambda *a, **k: table)
  assert script(new) == (0, (table + "\n", ""))
  assert (new / "table.md").read_text() == table + "\n"
  earlier = snapshot(new)

  def disk_fills(*a, **k):
    Faults(monkeypatch).full(new, free_bytes=len(table) // 2)
    return table.replace("1.000", "3.000")
  monkeypatch.setattr(compare, "run_all", disk_fills)
  code, out = script(new)
  assert code == errors.EXIT_STORAGE and out.out == table.replace("1.000", "3.000") + "\n", out
  _one_line(out.err, f"cannot write the table {new / 'table.md'}: no space left on the device")
  assert "The table above holds the results" in out.err and snapshot(new) == earlier
