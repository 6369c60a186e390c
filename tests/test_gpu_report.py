"""Tests of `python -m s24jax.gpu_report` (s24jax/gpu_report/) on a CPU: off a GPU it says so
and exits 2; its smoke run (tiny shapes, the cuSPARSELt stand-in) writes every section, with
figures checked against what they must be (the op through the stand-in equals 'xla': y and dX
exactly, dW but for one bf16 rounding); the budget (a tiny one: the later sections recorded
as skipped for it, the markdown written, exit 0); the record kept row by row (a SIGKILL
loses nothing written before it, and the markdown is rebuilt from what is left; a SIGTERM
ends the running section and writes the markdown); a failing
row recorded with its error while the next row runs; the pytest plugin's rows.

The report is GPU evidence, so on a GPU host the tests that assume no GPU are skipped and the
smoke runs are pinned to the CPU (JAX_PLATFORMS=cpu), as on any machine."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from s24jax import errors
from s24jax.gpu_report import cli
from s24jax.gpu_report import rows
from s24jax.gpu_report import steps

import faults

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = dict(os.environ, JAX_PLATFORMS="cpu")


def _report(tmp_path, *args, timeout=600):
  return subprocess.run([sys.executable, "-m", "s24jax.gpu_report", "--smoke", "--out",
                         str(tmp_path), *args], cwd=REPO, capture_output=True, text=True,
                        timeout=timeout, env=CPU)


def _by_section(record):
  out = {}
  for r in record:
    out.setdefault(r["section"], []).append(r)
  return out


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the message off a GPU")
def test_off_a_gpu_it_says_so_and_exits_2(capsys):
  assert cli.main([]) == cli.EXIT_NO_GPU
  err = capsys.readouterr().err
  assert "no GPU here" in err and "--smoke" in err


@pytest.mark.slow
def test_smoke_run_writes_every_section(tmp_path):
  run = _report(tmp_path, "--budget", "900", timeout=960)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  record = rows.read(str(tmp_path / "gpu_report_latest.jsonl"))
  md = (tmp_path / "gpu_report_latest.md").read_text()
  by = _by_section(record)
  assert "Smoke run on a CPU" in md and "Not run" not in md, md
  [env] = [r for r in by["environment"] if r["status"] == "ok"]
  assert env["platform"] == "cpu" and env["jax"] == jax.__version__
  # The pytest sections: one row per test from the plugin, and pytest's summary.
  gpu_tests = [r for r in by["gpu_tests"] if "outcome" in r]
  assert gpu_tests and all(r["outcome"] == "skipped" and "GPU" in r["reason"]   # its skip reason
                           for r in gpu_tests), gpu_tests
  quick = [r for r in by["quick_suite"] if "outcome" in r]
  assert quick and all(r["outcome"] == "passed" for r in quick), quick
  assert len({r["row"] for r in quick}) == len(quick)          # once each under xdist
  for name in ("gpu_tests", "quick_suite"):
    [summary] = [r for r in by[name] if r["row"] == "(summary)"]
    assert summary["exit_code"] == 0, summary
  gemms = [r for r in by["gemms"] if r["status"] == "ok"]
  assert {r["precision"] for r in gemms} == {"bf16", "fp8"}, by["gemms"]
  for r in gemms:
    e = r["max_rel_error_vs_xla"]
    assert e["y"] == 0 and e["dX"] == 0, r
    assert e["dW"] == 0 if r["precision"] == "fp8" else 0 < e["dW"] <= 2 ** -7, r
    for gemm in ("forward", "dgrad", "wgrad"):
      ms = r["ms"][gemm]
      assert all(ms[c] > 0 for c in ("sparse", "sparse+compress", "dense_xla")), r
  assert any(r["row"] == "torch peer" and r["status"] == "skipped" for r in by["gemms"])
  step_rows = [r for r in by["steps"] if r["status"] == "ok"]
  assert {r["backend"] for r in step_rows} == {"xla", "cusparselt"}, by["steps"]
  assert all(r["step_ms"] > 0 and math.isfinite(r["final_loss"]) for r in step_rows)
  for r in step_rows:    # the median of its rounds; a program digest per row
    assert len(r["step_ms_rounds"]) == steps.ROUNDS, r
    assert r["step_ms"] == pytest.approx(sorted(r["step_ms_rounds"])[steps.ROUNDS // 2], rel=1e-3)
  xla_row, forward_row = step_rows    # the forward on the stand-in: another program
  assert len(xla_row["program"]) == 12 and forward_row["program"] != xla_row["program"]
  assert md.count("| tiny (1) | hu2024 |") == 2 and "(= xla)" not in md, md
  assert record[-1]["row"] == "end" and "every section" in record[-1]["reason"]


def test_a_tiny_budget_skips_the_later_sections_and_still_writes(tmp_path):
  """30 s: the environment gets what is left after the report's start and its reserve; the
  other sections' caps are below their minimums, so each is recorded as skipped."""
  start = time.time()
  run = _report(tmp_path, "--budget", "30", timeout=120)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  assert time.time() - start < 30 + 10            # the budget, and the interpreter's start
  by = _by_section(rows.read(str(tmp_path / "gpu_report_latest.jsonl")))
  assert by["environment"], by
  for name in ("gpu_tests", "gemms", "steps", "quick_suite"):
    [r] = by[name]
    assert r["status"] == "skipped" and r["reason"].startswith("budget:"), r
  md = (tmp_path / "gpu_report_latest.md").read_text()
  assert md.count("- skipped (section): budget:") == 4, md


def test_rows_written_before_a_sigkill_are_kept(tmp_path):
  jsonl = tmp_path / "gpu_report_latest.jsonl"
  proc = subprocess.Popen([sys.executable, "-m", "s24jax.gpu_report", "--smoke", "--out",
                           str(tmp_path), "--sections", "environment,gemms"], cwd=REPO,
                          env=CPU, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)
  try:
    deadline = time.time() + 120
    while time.time() < deadline and not any(
        r["section"] == "environment" for r in rows.read(str(jsonl))):
      time.sleep(0.2)
  finally:
    os.killpg(proc.pid, signal.SIGKILL)      # the report and its section's process
    proc.wait()
  lines = jsonl.read_text().splitlines()
  record = [json.loads(line) for line in lines]   # every line written is whole
  assert record[0]["row"] == "start" and not any(r["row"] == "end" for r in record)
  [env] = [r for r in record if r["section"] == "environment"]
  assert env["status"] == "ok" and env["platform"] == "cpu", env
  rebuilt = subprocess.run([sys.executable, "-m", "s24jax.gpu_report", "--markdown-from",
                            str(jsonl)], cwd=REPO, capture_output=True, text=True, env=CPU,
                           timeout=120)
  assert rebuilt.returncode == 0, rebuilt.stderr
  md = (tmp_path / "gpu_report_latest.md").read_text()
  assert "Not ended" in md and "| platform |" not in md and "| device | cpu |" in md, md


def test_a_sigterm_ends_the_section_and_writes_the_markdown(tmp_path):
  jsonl = tmp_path / "gpu_report_latest.jsonl"
  proc = subprocess.Popen([sys.executable, "-m", "s24jax.gpu_report", "--smoke", "--out",
                           str(tmp_path), "--sections", "environment,gemms"], cwd=REPO,
                          env=CPU, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while time.time() < deadline and not rows.read(str(jsonl)):
    time.sleep(0.2)
  time.sleep(1.0)                            # inside the environment's process by now
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == errors.EXIT_PREEMPTED, out + err
  record = rows.read(str(jsonl))
  assert record[-1]["row"] == "end" and record[-1]["reason"] == "stopped by SIGTERM", record
  assert not any(r["section"] == "gemms" for r in record), record
  md = (tmp_path / "gpu_report_latest.md").read_text()
  assert "stopped by SIGTERM" in md and "## cuSPARSELt GEMMs\n\nNot run" in md, md


def test_a_failing_row_is_recorded_and_the_next_row_runs(tmp_path):
  path = str(tmp_path / "r.jsonl")
  section = rows.Section(path, "steps")
  with jax.default_device(jax.devices("cpu")[0]):
    steps.run(section, deadline=time.time() + 600, smoke=True, steps=1,
              rows=(("tiny", "nope", "xla", None), ("tiny", "dense", "xla", None)),
              recipes={"nope": "experiments/no_such_recipe.py",
                       "dense": "experiments/gpt2_dense.py"})
  bad, good = rows.read(path)
  assert bad["status"] == "failed" and "no_such_recipe.py" in bad["error"], bad
  assert "\n" not in bad["error"] and bad["error"].split(":")[0].isidentifier(), bad
  assert good["status"] == "ok" and math.isfinite(good["final_loss"]), good


def test_the_plugin_writes_each_test_as_it_ends(tmp_path):
  (tmp_path / "test_three.py").write_text(
      "import pytest\n"
      "def test_passes():\n  assert 1 + 1 == 2\n"
      "def test_fails():\n  assert [1, 2] == [1, 3], 'lists differ'\n"
      "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n  pass\n")
  path = tmp_path / "r.jsonl"
  run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
                        "s24jax.gpu_report.pytest_rows", "-p", "no:cacheprovider",
                        "test_three.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=dict(CPU, **{rows.ENV_JSONL: str(path),
                                                     "S24JAX_GPU_REPORT_SECTION": "t",
                                                     # as inherited from a suite under xdist
                                                     "PYTEST_XDIST_WORKER": "gw9"}))
  assert run.returncode == 1, run.stdout[-2000:]
  got = {r["row"].split("::")[1]: r for r in rows.read(str(path))}
  assert {k: r["outcome"] for k, r in got.items()} == {
      "test_passes": "passed", "test_fails": "failed", "test_skipped": "skipped"}
  assert got["test_fails"]["error"].startswith("AssertionError: lists differ"), got
  assert got["test_skipped"]["reason"] == "not here", got


@pytest.mark.parametrize("case", ["readonly", "full", "foreign_md", "foreign_folder",
                                  "file_as_out"])
def test_where_it_writes_is_checked_before_anything_runs(case, tmp_path, capsys, monkeypatch):
  """The report replaces its own earlier files only: a read-only or full folder, a file of
  another kind under the report's name, or a file where the folder should be is one line and
  exit 2, before any section runs, and every file is as it was."""
  out = tmp_path / "out"
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  if case == "foreign_md":
    (out / "gpu_report_latest.md").write_text("# my own notes\n")
  if case == "foreign_folder":
    (out / "gpu_report_latest").mkdir()
    (out / "gpu_report_latest" / "data.bin").write_bytes(b"\0" * 8)
  if case == "file_as_out":
    out = tmp_path / "notes_file"
    out.write_text("a file")
  before = faults.snapshot(tmp_path)
  with monkeypatch.context() as m:
    if case in ("readonly", "full"):
      getattr(faults.Faults(m), case)(str(out))
    m.setattr(cli, "run", lambda *a, **k: pytest.fail("a section ran"))
    code = cli.main(["--smoke", "--out", str(out), "--budget", "30"])
  err = capsys.readouterr().err
  assert code == errors.EXIT_USER, err
  assert err.count("\n") == 1 and "Traceback" not in err and str(out) in err, err
  assert faults.snapshot(tmp_path) == before


def test_a_step_row_with_the_xla_rows_program_is_marked():
  """The markdown marks a step row whose program is its recipe's 'xla' program (the same
  kernels: its time differs by noise only), and only that one."""
  from s24jax.gpu_report import markdown   # pylint: disable=g-import-not-at-top
  base = dict(section="steps", status="ok", variant="124m", layers=12, recipe="hu2024",
              micro_batch=64, tokens_per_sec=1.0, compiled_gib_per_device=1.0, compile_s=1.0)
  table = "\n".join(markdown._steps([   # pylint: disable=protected-access
      dict(base, backend="xla", step_ms=259.1, step_ms_rounds=[259.1, 258.0, 262.0],
           program="aaa"),
      dict(base, backend="cusparselt", step_ms=268.8, program="aaa"),
      dict(base, backend="cusparselt", gemm_choice="forward", step_ms=271.8, program="bbb"),
      dict(base, recipe="dense", backend="cusparselt", step_ms=270.0, program="aaa")]))
  rows = table.splitlines()[2:]
  assert "259.1 (258.0-262.0)" in rows[0] and rows[0].endswith("| aaa |"), rows
  assert rows[1].endswith("| aaa (= xla) |"), rows
  assert rows[2].endswith("| bbb |") and rows[3].endswith("| aaa |"), rows  # no xla row of its own
