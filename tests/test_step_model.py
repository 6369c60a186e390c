"""Tests for s24jax/roofline.py and the step_model command (s24jax/step_model/): a kernel's
time against the roofline worked by hand, the cuSPARSELt table's scaling rule by hand, the fit
recovering known constants from step times the model itself generated, the measured run's
rows read as the library's GEMM shapes, the named scopes the census relies on, and the
command's one-line errors (exit 2)."""
import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import pytest

from s24jax import roofline as rl
from s24jax import step_census as sc
from s24jax.step_model import build
from s24jax.step_model import calibration as cal
from s24jax.step_model import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C = rl.Constants(flops_per_s=400e12, bytes_per_s=2.5e12, launch_s=4e-6)


def kernel(category=sc.OTHER, count=1, flops=0.0, nbytes=0.0, **kw):
  return sc.Kernel(name="k", opcode="fusion", target=kw.pop("target", ""), category=category,
                   count=count, flops=flops, bytes=nbytes, op_name=kw.pop("op_name", ""), **kw)


def test_kernel_time_is_the_roofline():
  gemm = kernel(sc.DENSE_GEMM, flops=4e12, nbytes=1e9)            # compute-bound: 10 ms
  assert math.isclose(rl.kernel_seconds(gemm, C), 4e12 / 400e12 + 4e-6)
  fp8 = dataclasses.replace(gemm, fp8_gemm=True)                  # twice the rate
  assert math.isclose(rl.kernel_seconds(fp8, C), 4e12 / 800e12 + 4e-6)
  copy = kernel(sc.TRANSPOSE, flops=1e6, nbytes=5e9)              # bandwidth-bound: 2 ms
  assert math.isclose(rl.kernel_seconds(copy, C), 5e9 / 2.5e12 + 4e-6)
  step = [gemm, dataclasses.replace(copy, count=3),
          dataclasses.replace(copy, count=100, branch="cond:true")]   # a branch: left out
  assert math.isclose(rl.step_seconds(step, C),
                      4e12 / 400e12 + 3 * 5e9 / 2.5e12 + 4 * 4e-6)


TABLE = rl.SparseTable((
    # forward: W~ (N 3072, K 768) at T 8192 -> the library's (m, n, k) = (N, T, K)
    rl.SparseGemm("forward", "bf16", 3072, 8192, 768, sparse_ms=0.30, compress_ms=0.02,
                  dense_ms=0.15),
    rl.SparseGemm("dgrad", "bf16", 768, 8192, 3072, sparse_ms=0.20, compress_ms=0.08,
                  dense_ms=0.10),
    rl.SparseGemm("wgrad", "bf16", 3072, 768, 8192, sparse_ms=0.22, compress_ms=0.90,
                  dense_ms=0.09),
))


def test_cusparselt_calls_scale_the_measured_table():
  g = TABLE.get("forward", "bf16")
  flops = 2.0 * 3072 * 8192 * 768
  # the model's dense GEMM of the measured product, and the dispatch the table's times hold
  dense_bytes = 2 * (3072 * 768 + 768 * 8192) + 2 * 3072 * 8192
  dense_model = max(flops / C.flops_per_s, dense_bytes / C.bytes_per_s) + C.launch_s
  dispatch = 0.15e-3 - dense_model
  assert dispatch > 0
  spmm = kernel(sc.SPARSE_GEMM, flops=8 * flops, target="cusparselt_spmm",
                op_name="jit(train_step)/jvp(GPT2)/mlp/fc/ffi_call",
                attributes={"a_dtype": "bf16", "d_row_major": "false"})
  assert rl.gemm_kind(spmm) == "forward" and rl.precision(spmm) == "bf16"
  assert math.isclose(rl.kernel_seconds(spmm, C, TABLE),
                      (0.30e-3 - dispatch) * 8 + C.launch_s, rel_tol=1e-12)
  wgrad = dataclasses.replace(spmm, op_name="jit(train_step)/transpose(jvp(GPT2))/ffi_call",
                              attributes={"a_dtype": "bf16", "d_row_major": "true"})
  dgrad = dataclasses.replace(wgrad, attributes={"a_dtype": "bf16", "d_row_major": "false"})
  remat = dataclasses.replace(dgrad, op_name="jit(train_step)/transpose(jvp(GPT2))/"
                              "rematted_computation/ffi_call")
  assert [rl.gemm_kind(k) for k in (wgrad, dgrad, remat)] == ["wgrad", "dgrad", "forward"]
  # compression by bytes: the estimate (in the backward) at the wgrad row's rate, the
  # weights at the mean of the forward and dgrad rows' rates
  estimate = kernel(sc.COMPRESSION, target="cusparselt_compress", operand_bytes=2 * 3072 * 8192 * 4,
                    op_name="jit(train_step)/transpose(jvp(GPT2))/ffi_call",
                    attributes={"b_dtype": "bf16"})
  assert math.isclose(rl.kernel_seconds(estimate, C, TABLE), 4 * 0.90e-3 + C.launch_s)
  weight = dataclasses.replace(estimate, op_name="jit(train_step)/vmap()/ffi_call",
                               operand_bytes=2 * 3072 * 768)
  rate = (2 * 3072 * 768 / 0.02e-3 + 2 * 768 * 3072 / 0.08e-3) / 2
  assert math.isclose(rl.kernel_seconds(weight, C, TABLE), 2 * 3072 * 768 / rate + C.launch_s)
  with pytest.raises(ValueError, match="SparseTable"):
    rl.kernel_seconds(spmm, C)


def _synthetic_steps():
  """Steps of different make-up (GEMM-heavy, bandwidth-heavy, launch-heavy, a cuSPARSELt
  call), so the three constants are each pinned."""
  gemm = kernel(sc.DENSE_GEMM, flops=3e11, nbytes=2e8)
  fp8 = kernel(sc.DENSE_GEMM, flops=3e11, nbytes=1e8, fp8_gemm=True)
  moves = kernel(sc.OTHER, flops=1e7, nbytes=8e8)
  tiny = kernel(sc.OTHER, flops=1e3, nbytes=4e3)
  spmm = kernel(sc.SPARSE_GEMM, flops=2.0 * 3072 * 65536 * 768, target="cusparselt_spmm",
                op_name="jvp/ffi_call", attributes={"a_dtype": "bf16", "d_row_major": "false"})
  mixes = [(40, 5, 2000, 0), (5, 0, 300, 0), (10, 40, 500, 0), (20, 0, 100, 24),
           (1, 1, 20000, 0), (30, 10, 1000, 12)]
  return [[dataclasses.replace(gemm, count=a), dataclasses.replace(moves, count=b),
           dataclasses.replace(tiny, count=c), dataclasses.replace(spmm, count=d),
           dataclasses.replace(fp8, count=1 + a // 2)] for a, b, c, d in mixes]


def test_fit_recovers_the_constants_that_made_the_rows():
  truth = rl.Constants(flops_per_s=550e12, bytes_per_s=2.2e12, launch_s=6e-6)
  rows = [rl.Row(f"r{i}", tuple(ks), rl.step_seconds(ks, truth, TABLE))
          for i, ks in enumerate(_synthetic_steps())]
  got = rl.fit(rows, TABLE)
  assert math.isclose(got.flops_per_s, truth.flops_per_s, rel_tol=1e-3)
  assert math.isclose(got.bytes_per_s, truth.bytes_per_s, rel_tol=1e-3)
  assert math.isclose(got.launch_s, truth.launch_s, rel_tol=1e-3)


def test_the_runs_gemm_rows_as_the_librarys_shapes():
  """gemms_run2.jsonl's fc row: W~ (3072, 768) at 8192 tokens; the forward's (m, n, k) is
  (N, T, K), the data gradient's (K, T, N), the weight gradient's (N, K, T)."""
  table = cal.sparse_table()
  f, d, w = (table.get(kind, "bf16") for kind in rl.GEMM_KINDS)
  assert (f.m, f.n, f.k) == (3072, 8192, 768)
  assert (d.m, d.n, d.k) == (768, 8192, 3072)
  assert (w.m, w.n, w.k) == (3072, 768, 8192)
  assert f.flops == d.flops == w.flops == 2.0 * 3072 * 768 * 8192
  assert all(g.compress_ms > 0 and g.sparse_ms > g.dense_ms for g in table.gemms)
  measured = cal.measured_steps()
  assert {("dense", "xla"), ("hu2024", "cusparselt"), ("s_ste", "cusparselt")} <= set(measured)


def test_the_library_names_the_mvue_kernels():
  """masks.mvue24 runs in its named scope, which the census reads back from compiled HLO;
  a plain jnp function of the same shape has no such kernel."""
  from s24jax.kernels import masks   # pylint: disable=g-import-not-at-top
  x = jnp.arange(64, dtype=jnp.float32).reshape(4, 16)
  lowered = jax.jit(lambda x: masks.mvue24(jax.random.key(0), x) * 2).lower(x)
  # (the lowered text: a compilation cache may key executables without their metadata)
  assert "/mvue/" in lowered.as_text(debug_info=True)
  assert any(k.category == sc.MVUE for k in sc.census(lowered.compile().as_text()))
  plain = jax.jit(lambda x: jnp.where(x > 3, x, 0) * 2).lower(x)
  assert not any(k.category == sc.MVUE for k in sc.census(plain.compile().as_text()))


@pytest.mark.parametrize("argv, message", [
    (["census", "--config", os.path.join(REPO, "experiments", "no_such_file.py:124m")],
     "not found"),
    (["census", "--config", os.path.join(REPO, "experiments", "gpt2_dense.py:no_such")],
     "variant"),
    (["census"], "--config or --hlo"),
    (["report", "--rows", "124m,9000m"], "9000m"),
])
def test_a_bad_command_is_one_line_and_exit_2(argv, message, capsys):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and message in err and err.startswith("s24jax.step_model:")


def test_the_committed_predictions_come_from_the_committed_calibration():
  """docs/step_model_predictions.json's constants and calibration rows are what the model
  fits now to docs/step_model_calibration.json and the run's step times (regenerate both
  together: docs/scaling.md), and it covers every predicted row and arm."""
  with open(os.path.join(REPO, "docs", "step_model_predictions.json"), encoding="utf-8") as f:
    saved = json.load(f)
  assert "PREDICTIONS" in saved["what"] and saved["device"] == cal.RUN_DEVICE
  c, table, rows = cli.calibrate()
  assert math.isclose(c.flops_per_s, saved["constants"]["flops_per_s"], rel_tol=1e-3)
  assert math.isclose(c.bytes_per_s, saved["constants"]["bytes_per_s"], rel_tol=1e-3)
  assert abs(c.launch_s - saved["constants"]["launch_s"]) < 1e-7
  for row, entry in zip(rows, saved["calibration"]):
    assert entry["row"] == row.name
    assert math.isclose(entry["measured_ms"], 1e3 * row.seconds)
    assert math.isclose(entry["model_ms"], 1e3 * rl.step_seconds(row.kernels, c, table),
                        rel_tol=1e-3)
  got = {(r["name"], r["recipe"], r["backend"]) for r in saved["rows"]}
  assert got == {(p[0], recipe, backend) for p in cli.PREDICTIONS for recipe, backend in cli.ARMS}


def test_census_of_an_xla_dump_folder(tmp_path, capsys):
  """`census --hlo DIR` reads the step's after-optimizations dump (XLA_FLAGS=--xla_dump_to),
  e.g. from a GPU host: the hand-written module of tests/test_step_census.py."""
  import test_step_census   # pylint: disable=g-import-not-at-top (tests/ is on sys.path)
  (tmp_path / "module_0001.jit_train_step.sm_9.0_gpu_after_optimizations.txt").write_text(
      test_step_census.HLO)
  assert cli.main(["census", "--hlo", str(tmp_path), "--kernels", "3"]) == 0
  out = capsys.readouterr().out
  assert "| dense GEMM | 2 / " in out and "| sparse GEMM | 1 / " in out
  assert cli.main(["census", "--hlo", str(tmp_path / "missing")]) == 2
