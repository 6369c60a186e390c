"""Tests of s24jax/gpu_report.py: off a GPU the command says so and exits 2; its CPU smoke run
(tiny shapes, the cuSPARSELt stand-in) writes the Markdown and JSON report, whose figures are
checked against what they must be: the op through the stand-in equals 'xla' (y, dX; dW but for
one bf16 rounding), every step row trained to a finite loss."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_off_a_gpu_it_says_so_and_exits_2(capsys):
  from s24jax import gpu_report   # pylint: disable=g-import-not-at-top
  assert gpu_report.main([]) == gpu_report.EXIT_NO_GPU
  err = capsys.readouterr().err
  assert "no GPU here" in err and "--smoke" in err


@pytest.mark.slow
def test_smoke_run_writes_the_report(tmp_path):
  run = subprocess.run([sys.executable, "-m", "s24jax.gpu_report", "--smoke", "--out",
                        str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  report = json.loads((tmp_path / "gpu_report.json").read_text())
  md = (tmp_path / "gpu_report.md").read_text()
  assert report["smoke"] and "Smoke run on a CPU" in md
  assert report["environment"]["platform"] == "cpu" and "gpu_tests" not in report
  assert {(r["matrix"], r["precision"]) for r in report["gemms"]} == {("fc", "bf16"),
                                                                     ("fc", "fp8")}
  for r in report["gemms"]:
    e = r["max_rel_error_vs_xla"]
    assert e["y"] == 0 and e["dX"] == 0, r
    assert e["dW"] == 0 if r["precision"] == "fp8" else 0 < e["dW"] <= 2 ** -7, r
    assert set(r["ms"]) == {"forward", "dgrad", "wgrad"}
  steps = {(r["recipe"], r["backend"]) for r in report["steps"]}
  assert steps == {("hu2024", "xla"), ("hu2024", "cusparselt")}
  assert all(r["step_ms"] > 0 and r["final_loss"] == r["final_loss"] for r in report["steps"])
  assert md.count("| tiny | hu2024 |") == 2
