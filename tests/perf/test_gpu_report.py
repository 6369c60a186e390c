"""Tests of `python -m s24jax.perf.gpu_report` (s24jax/perf/gpu_report/) on a CPU: off a GPU it says so
and exits 2; its smoke run (tiny shapes, the cuSPARSELt stand-in) writes every section, with
figures checked against what they must be (the stand-in's layouts agree with s24jax's, every
timing positive, the libraries named); the budget (a tiny one: the later sections recorded
as skipped for it, the markdown written, exit 0); the record kept row by row (a SIGKILL
loses nothing written before it, and the markdown is rebuilt from what is left; a SIGTERM
ends the running section and writes the markdown); a failing row recorded with its error
while the next row runs; the pytest plugin's rows and the libraries of their process; the
warning when the serving cuSPARSELt is not the pinned one; the Llama slice's config; the
markdown's tables. tests/perf/test_gpu_report_gemms.py tests the cuSPARSELt sections' rows.

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

from s24jax import config_files
from s24jax import errors
from s24jax.training import run_spec
from s24jax.perf.gpu_report import cli
from s24jax.perf.gpu_report import env as env_lib
from s24jax.perf.gpu_report import markdown
from s24jax.perf.gpu_report import layouts
from s24jax.perf.gpu_report import rows
from s24jax.perf.gpu_report import steps
from s24jax.kernels.cusparselt import library

import faults

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = dict(os.environ, JAX_PLATFORMS="cpu")


def _report(tmp_path, *args, timeout=600):
  return subprocess.run([sys.executable, "-m", "s24jax.perf.gpu_report", "--smoke", "--out",
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
  assert env["libraries"]["cusparselt_serving"]["version"] == record[0]["cusparselt_pinned"]
  assert "torch" in env["libraries"] and "WARNING" not in run.stdout      # the pinned one ran
  layout_rows = [r for r in by["layouts"] if r["status"] == "ok"]
  assert layout_rows and all(r["mismatch"] is None for r in layout_rows), by["layouts"]
  gemms = [r for r in by["gemms"] if r["status"] == "ok"]
  assert {(r["kind"], r["precision"]) for r in gemms} == {
      (k, p) for k in ("forward", "dgrad", "wgrad") for p in ("bf16", "fp8")}, by["gemms"]
  for r in gemms:
    assert r["errors"] == {} and r["alg_check"] is None, r
    assert all(r["ms"][c] > 0 for c in ("sparse", "sparse_searched", "compress_library",
                                        "compress_library+sparse", "dense_xla")), r
    assert r["libraries"]["cusparselt_serving"] == env["libraries"]["cusparselt_serving"]
  assert any(r["row"] == "torch peer" and r["status"] == "skipped" for r in by["gemms"])
  assert "| s24jax GB/s | vs dense |" in md and "**fp8**" in md, md
  step_rows = [r for r in by["steps"] if r["status"] == "ok"]
  assert {r["backend"] for r in step_rows} == {"xla", "cusparselt"}, by["steps"]
  assert all(r["step_ms"] > 0 and math.isfinite(r["final_loss"]) for r in step_rows)
  assert all(r["libraries"]["cusparselt_serving"] for r in step_rows), step_rows
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
  for name in ("layouts", "gpu_tests", "gemms", "steps", "quick_suite"):
    [r] = by[name]
    assert r["status"] == "skipped" and r["reason"].startswith("budget:"), r
  md = (tmp_path / "gpu_report_latest.md").read_text()
  assert md.count("- skipped (section): budget:") == 5, md


def test_rows_written_before_a_sigkill_are_kept(tmp_path):
  jsonl = tmp_path / "gpu_report_latest.jsonl"
  proc = subprocess.Popen([sys.executable, "-m", "s24jax.perf.gpu_report", "--smoke", "--out",
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
  rebuilt = subprocess.run([sys.executable, "-m", "s24jax.perf.gpu_report", "--markdown-from",
                            str(jsonl)], cwd=REPO, capture_output=True, text=True, env=CPU,
                           timeout=120)
  assert rebuilt.returncode == 0, rebuilt.stderr
  md = (tmp_path / "gpu_report_latest.md").read_text()
  assert "Not ended" in md and "| platform |" not in md and "| device | cpu |" in md, md


def test_a_sigterm_ends_the_section_and_writes_the_markdown(tmp_path):
  jsonl = tmp_path / "gpu_report_latest.jsonl"
  proc = subprocess.Popen([sys.executable, "-m", "s24jax.perf.gpu_report", "--smoke", "--out",
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
  assert good["libraries"]["cusparselt_serving"] == library.serving(), good["libraries"]


def test_the_plugin_writes_each_test_as_it_ends(tmp_path):
  (tmp_path / "test_three.py").write_text(
      "import pytest\n"
      "def test_passes():\n  assert 1 + 1 == 2\n"
      "def test_fails():\n  assert [1, 2] == [1, 3], 'lists differ'\n"
      "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n  pass\n"
      "def test_zz_loads_the_handlers():\n"      # runs last: the others' process has none
      "  from s24jax.kernels.cusparselt import library\n  library.register()\n")
  path = tmp_path / "r.jsonl"
  run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
                        "s24jax.perf.gpu_report.pytest_rows", "-p", "no:cacheprovider",
                        "test_three.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=dict(CPU, **{rows.ENV_JSONL: str(path),
                                                     "S24JAX_GPU_REPORT_SECTION": "t",
                                                     # as inherited from a suite under xdist
                                                     "PYTEST_XDIST_WORKER": "gw9"}))
  assert run.returncode == 1, run.stdout[-2000:]
  got = {r["row"].split("::")[1]: r for r in rows.read(str(path))}
  assert {k: r["outcome"] for k, r in got.items()} == {
      "test_passes": "passed", "test_fails": "failed", "test_skipped": "skipped",
      "test_zz_loads_the_handlers": "passed"}
  assert got["test_fails"]["error"].startswith("AssertionError: lists differ"), got
  assert got["test_skipped"]["reason"] == "not here", got
  # The libraries of the test's process, as the test left it: named once it loaded them.
  assert "libraries" not in got["test_skipped"], got
  first, last = got["test_passes"]["libraries"], got["test_zz_loads_the_handlers"]["libraries"]
  assert first["pid"] == last["pid"] != os.getpid() and first["cusparselt_serving"] is None
  assert last["cusparselt_serving"] == library.serving(), last
  assert last["cusparselt_serving"]["path"] in last["cusparselt_mapped"], last


@pytest.mark.parametrize("case", ["readonly", "full", "foreign_md", "foreign_jsonl",
                                  "foreign_folder", "file_as_out"])
def test_where_it_writes_is_checked_before_anything_runs(case, tmp_path, capsys, monkeypatch):
  """The report replaces its own earlier files only: a read-only or full folder, a file of
  another kind under the report's name, or a file where the folder should be is one line and
  exit 2, before any section runs, and every file is as it was."""
  out = tmp_path / "out"
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  if case == "foreign_md":
    (out / "gpu_report_latest.md").write_text("# my own notes\n")
  if case == "foreign_jsonl":   # another tool's rows under the report's name
    (out / "gpu_report_latest.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
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


@pytest.mark.parametrize("serving_version", ["0.8.0", "pinned"])
def test_a_report_on_another_cusparselt_says_so_first(serving_version, tmp_path, monkeypatch,
                                                      capsys):
  """The environment's row names the library that serves s24jax; when its version is not
  the one requirements-cusparselt.txt pins, the markdown's first lines and the command's
  output say so with both versions, and only then."""
  pinned = library.pinned_version()
  version = pinned if serving_version == "pinned" else serving_version
  fake = {"path": f"/opt/cusparselt-{version}/libcusparseLt.so.0", "version": version}
  monkeypatch.setattr(library, "serving", lambda: fake)
  env = env_lib.environment()
  libs = env["libraries"]
  assert libs["cusparselt_serving"] == fake and isinstance(libs["pid"], int)
  assert isinstance(libs["cusparselt_mapped"], list) and isinstance(
      libs["cusparselt_load_order"], list)
  if not env["torch"].startswith("not importable"):      # torch's side, after torch loaded
    assert set(libs["torch"]) >= {"mapped_after_torch", "load_order_after_torch"}, libs
  jsonl = str(tmp_path / "r.jsonl")
  rows.append(jsonl, {"section": "report", "row": "start", "status": "ok", "command": "c",
                      "budget": 1.0, "smoke": False, "sections": ["environment"],
                      "cusparselt_pinned": cli.pinned_cusparselt()})
  rows.append(jsonl, {"section": "environment", "row": "environment", "status": "ok", **env})
  top = "\n".join(markdown.render(rows.read(jsonl)).splitlines()[:3])
  warned = cli.print_warning(jsonl)
  out = capsys.readouterr().out
  if serving_version == "pinned":
    assert warned is None and out == "" and "not the version" not in top, top
    return
  for text in (top, out):
    assert f"cuSPARSELt 0.8.0 ({fake['path']})" in text and f"pins, {pinned} " in text, text
  assert out.startswith("s24jax.perf.gpu_report: WARNING: This report ran on") and \
      out.count("\n") == 1, out


def test_the_llama_slice_is_7bs_width_cut_to_two_layers_at_65536_tokens():
  variant, overrides = steps.VARIANTS["llama7b/2"]
  path = steps.recipe_file("llama7b/2", "hu2024")
  assert path.endswith("experiments/llama_t_sr_ste_df.py"), path
  config = config_files.load_config(f"{path}:{variant}", args=overrides)
  micro = config.batch_size // config.grad_accum_steps
  model = run_spec.RunSpec.build(config).model_cfg
  # Llama 2 7B: width 4096, FFN 11008 (s24jax/training/config.py LLAMA_SIZES); 2 of its 32 layers.
  assert (model.family, model.d_model, model.mlp_hidden, model.num_layers) == (
      "llama", 4096, 11008, 2)
  assert micro * model.seq_len == 65536 and model.seq_len == 2048
  assert steps.recipe_file("124m", "hu2024").endswith("experiments/gpt2_t_sr_ste_df.py")
  assert [r[:3] for r in steps.ROWS[:2]] == [("llama7b/2", "hu2024", "xla"),
                                            ("llama7b/2", "hu2024", "cusparselt")]


def test_the_markdown_shows_a_gemm_row_and_a_layout_row():
  """A GEMM row's cells (the times, the bandwidth ratio, the speed-up with compressions)
  and a layout row whose bytes differ (its verdict and files), from hand-made rows."""
  ms = {"sparse": 0.8, "sparse_searched": 0.7, "compress_s24jax": 0.05,
        "compress_library": 0.4, "compress_s24jax+sparse": 0.85,
        "compress_library+sparse": 1.2, "dense_xla": 1.0, "torch_sparse": None,
        "torch_sparse+compress": None}
  gemm = dict(section="gemms", row="forward ...", status="ok", kind="forward", matrix="fc",
              shape_NK=[3072, 768], tokens=65536, precision="bf16", ms=ms,
              gemm=dict(m=3072, n=65536, k=768, layout="TN"),
              algorithm=dict(alg_id=3, max_id=7), alg_check=None, alg_check_skipped=None,
              compression_bandwidth=dict(gb_per_s=2457.6, ratio_to_ideal=1.3631),
              vs_dense=dict(kernel_speedup=1 / 0.7, kernel_faster=True,
                            with_compression_speedup={"s24jax": 1 / 0.85, "library": 1 / 1.2}),
              errors={"torch": "ImportError: no torch"})
  layout_row = dict(section="layouts", row="bf16 (3072, 768)", status="ok", dtype="bf16",
                    m=3072, k=768, used_by=["124m W~ 3072x768 forward"], layout="sm90_16bit",
                    mismatch="3 value and 0 metadata bytes differ",
                    files=["r/layouts/bf16_3072x768_probe.npy",
                           "r/layouts/bf16_3072x768_library.npy"])
  md = markdown.render([gemm, layout_row])
  [line] = [l for l in md.splitlines() if l.startswith("| forward |")]
  cells = [c.strip() for c in line.strip("|").split("|")]
  assert cells[:4] == ["forward", "fc (3072, 768)", "65536", "(3072, 65536, 768) TN"], cells
  assert cells[4:9] == ["0.800 / 0.700", "0.850 / 1.200", "1.000", "- / -", "0.050 / 0.400"]
  assert cells[9:] == ["2458 (1.36x ideal)", "1.43x; with compression 1.18 / 0.83",
                       "id 3 of 7", "agrees"], cells
  assert "- forward ... torch: `ImportError: no torch`" in md
  [line] = [l for l in md.splitlines() if l.startswith("| bf16 | (3072, 768) |")]
  assert "**differ**: 3 value and 0 metadata bytes differ" in line
  assert "[bf16_3072x768_probe.npy](r/layouts/bf16_3072x768_probe.npy)" in line, line


def test_a_step_pair_runs_whole_or_not_and_counts_its_first_layout_checks(tmp_path,
                                                                           monkeypatch):
  """124m's Hu et al. 'cusparselt' step first checks 4 bf16 operand shapes: W~ (3072, 768),
  W~^T (768, 3072), the MVUE estimates (3072, 65536) and (768, 65536): 4 cases of
  CASE_SECONDS and 256,376,832 probe values at PROBE_SECONDS_PER_VALUE. With its 'xla' pair
  (25 + 25 s) the pair needs that much more: with a second less the pair is skipped whole
  and the next row runs; once checked, no more."""
  first = (4 * layouts.CASE_SECONDS + layouts.PROBE_SECONDS_PER_VALUE
           * (2 * 3072 * 768 + 3072 * 65536 + 768 * 65536))
  assert steps.first_use_seconds("124m", "hu2024", "cusparselt", set()) == pytest.approx(first)
  checked = {("bf16", 3072, 768), ("bf16", 768, 3072), ("bf16", 3072, 65536),
             ("bf16", 768, 65536)}
  assert steps.first_use_seconds("124m", "hu2024", "cusparselt", checked) == 0
  assert steps.first_use_seconds("124m", "hu2024", "xla", set()) == 0
  monkeypatch.setattr(steps, "step_seconds", lambda *a, **k: {"step_ms": 1.0})
  path = str(tmp_path / "r.jsonl")
  need = 25 + 25 + first
  steps.run(rows.Section(path, "steps"), deadline=time.time() + need - 1, smoke=False,
            rows=(("124m", "hu2024", "xla", None), ("124m", "hu2024", "cusparselt", None),
                  ("124m", "dense", "xla", None)))
  xla, sparse, dense = rows.read(path)
  assert xla["status"] == "skipped" and f"needs about {need:.0f} s" in xla["reason"], xla
  assert f"{first:.0f} s of it its first checks" in xla["reason"], xla
  assert sparse["status"] == "skipped" and "'xla' pair did not fit" in sparse["reason"]
  assert dense["status"] == "ok" and dense["libraries"]["cusparselt_serving"], dense
