"""Tests for s24jax/perf/roofline.py and the step_model command (s24jax/perf/step_time/): a kernel's
time against the roofline worked by hand, the cuSPARSELt table's scaling rule by hand, the fit
recovering known constants from step times the model itself generated, leave-one-out and
Kendall's tau against hand counts, the measured runs' rows read as written, the named scopes
the census relies on, and the predictions file as a function of code and calibration. The
command's error path: tests/perf/test_step_time_cli.py."""
import dataclasses
import hashlib
import itertools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from s24jax.perf import roofline as rl
from s24jax.perf import step_census as sc
from s24jax.perf.step_time import calibration as cal
from s24jax.perf.step_time import cli
from s24jax.perf.step_time import predict
from s24jax.perf.step_time import validation

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
  # compression by bytes: the estimate (in the backward) at the wgrad row's rate, a weight
  # at the rate of the forward or dgrad row nearest to the GEMM it serves (its m, n, k)
  estimate = kernel(sc.COMPRESSION, target="cusparselt_compress", operand_bytes=2 * 3072 * 8192 * 4,
                    op_name="jit(train_step)/transpose(jvp(GPT2))/ffi_call",
                    attributes={"b_dtype": "bf16"})
  assert math.isclose(rl.kernel_seconds(estimate, C, TABLE), 4 * 0.90e-3 + C.launch_s)
  weight = dataclasses.replace(estimate, op_name="jit(train_step)/vmap()/ffi_call",
                               operand_bytes=2 * 3072 * 768,
                               attributes={"b_dtype": "bf16", "m": "768", "n": "65536",
                                           "k": "3072"})          # W~^T for the dgrad
  assert math.isclose(rl.kernel_seconds(weight, C, TABLE), 0.08e-3 + C.launch_s)
  with pytest.raises(ValueError, match="SparseTable"):
    rl.kernel_seconds(spmm, C)


def test_the_table_row_nearest_the_call_averaged_and_loop_timed():
  """Two shapes measured (one twice, loop-timed: no dispatch to take off): a call takes the
  nearest shape's mean, scaled by FLOPs."""
  fc = rl.SparseGemm("forward", "bf16", 3072, 65536, 768, 0.70, 0.06, 0.48, host_timed=False)
  proj = rl.SparseGemm("forward", "bf16", 768, 65536, 3072, 0.44, 0.10, 0.46,
                       host_timed=False)
  table = rl.SparseTable((fc, proj, dataclasses.replace(proj, sparse_ms=0.46)))
  call = kernel(sc.SPARSE_GEMM, flops=2.0 * 768 * 32768 * 3072, target="cusparselt_spmm",
                op_name="jvp/ffi_call", gemm_mnk=(768, 32768, 3072),
                attributes={"a_dtype": "bf16", "d_row_major": "false"})
  assert math.isclose(rl.kernel_seconds(call, C, table), 0.45e-3 / 2 + C.launch_s)
  wide = dataclasses.replace(call, gemm_mnk=(4096, 65536, 1024), flops=2.0 * 4096 * 65536 * 1024)
  scale = 4096 * 1024 / (3072 * 768)
  assert math.isclose(rl.kernel_seconds(wide, C, table), 0.70e-3 * scale + C.launch_s)
  with pytest.raises(KeyError, match="fp8"):
    rl.kernel_seconds(dataclasses.replace(call, attributes={"a_dtype": "e4m3"}), C, table)


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


def _brute_force_pairs(a, b):
  """(concordant, discordant, tied) pairs of two sequences, one pair at a time."""
  counts = [0, 0, 0]
  for i, j in itertools.combinations(range(len(a)), 2):
    product = (a[i] - a[j]) * (b[i] - b[j])
    counts[0 if product > 0 else 1 if product < 0 else 2] += 1
  return tuple(counts)


def test_kendall_counts_pairs_as_a_brute_force_count_does():
  """By hand: measured 1 < 2 < 3 < 4, the model 1, 3, 2, 2: pairs (1,2) (1,3) (1,4)
  concordant, (2,3) discordant, (2,4) discordant, (3,4) tied in the model. tau-b against
  scipy's, on that and on random sequences with ties; the widest discordant pair by hand."""
  r = validation.kendall([1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 2.0])
  assert (r.concordant, r.discordant, r.tied) == (3, 2, 1)
  assert math.isclose(r.tau, (3 - 2) / math.sqrt(6 * 5))
  assert math.isclose(r.widest_discordant, 4.0 / 2.0 - 1)     # the pair (2, 4)
  rng = np.random.default_rng(0)
  for _ in range(20):
    a, b = rng.integers(1, 7, 9).astype(float), rng.integers(1, 7, 9).astype(float)
    r = validation.kendall(a, b)
    assert (r.concordant, r.discordant, r.tied) == _brute_force_pairs(a, b)
    if len(set(a)) > 1 and len(set(b)) > 1:
      assert math.isclose(r.tau, stats.kendalltau(a, b).statistic)
  perfect = validation.kendall([3.0, 1.0, 2.0], [30.0, 10.0, 20.0])
  assert (perfect.tau, perfect.discordant, perfect.widest_discordant) == (1.0, 0, 0.0)


def _measured(rows):
  run = cal.RUNS[0]
  return [cal.Measured(run, r, (1e3 * r.seconds,)) for r in rows]


def test_leave_one_out_predicts_each_row_from_the_others():
  """Rows made by known constants: left out, each is predicted exactly (the others pin the
  constants); one row's time then off by +25 %: its in-sample error is smaller than its
  leave-one-out error, which is the model's true time against it (1 / 1.25 - 1)."""
  truth = rl.Constants(flops_per_s=550e12, bytes_per_s=2.2e12, launch_s=6e-6)
  steps = _synthetic_steps()
  rows = [rl.Row(f"r{i}", tuple(ks), rl.step_seconds(ks, truth, TABLE))
          for i, ks in enumerate(steps)]
  exact = validation.fit_device(cal.RUNS[:1], _measured(rows), TABLE)
  assert max(abs(e) for e in exact.errors(loo=True)) < 1e-4
  assert exact.summary(loo=True)["kendall_tau"] == 1.0
  off = [dataclasses.replace(r, seconds=1.25 * r.seconds) if i == 2 else r
         for i, r in enumerate(rows)]
  fit = validation.fit_device(cal.RUNS[:1], _measured(off), TABLE)
  assert math.isclose(fit.errors(loo=True)[2], 1 / 1.25 - 1, rel_tol=1e-3)
  assert abs(fit.errors()[2]) < abs(fit.errors(loo=True)[2])
  summary = fit.summary(loo=True)
  assert math.isclose(summary["max_abs_error"], max(abs(e) for e in fit.errors(loo=True)))
  assert math.isclose(summary["median_abs_error"],
                      float(np.median(np.abs(fit.errors(loo=True)))))
  row = validation.device_json(fit)["rows"][2]
  assert math.isclose(row["loo_model_ms"], 1e3 * rows[2].seconds, rel_tol=1e-3)


def test_the_runs_gemm_rows_as_the_librarys_shapes():
  """gemms_run2.jsonl's fc row: W~ (3072, 768) at 8192 tokens; the forward's (m, n, k) is
  (N, T, K), the data gradient's (K, T, N), the weight gradient's (N, K, T). The H100's rows
  are single host-timed calls, the H200's a jitted loop's (its report's rows and the
  first-use times, one shape measured twice)."""
  h100, h200 = cal.RUNS
  table = cal.sparse_table(h100.path)
  f, d, w = (table.get(kind, "bf16") for kind in rl.GEMM_KINDS)
  assert (f.m, f.n, f.k) == (3072, 8192, 768)
  assert (d.m, d.n, d.k) == (768, 8192, 3072)
  assert (w.m, w.n, w.k) == (3072, 768, 8192)
  assert f.flops == d.flops == w.flops == 2.0 * 3072 * 768 * 8192
  assert all(g.compress_ms > 0 and g.sparse_ms > g.dense_ms and g.host_timed
             for g in table.gemms)
  table = cal.sparse_table(h200.path)
  assert not any(g.host_timed for g in table.gemms)
  fc = [g for g in table.gemms if (g.kind, g.precision, g.mnk) == ("wgrad", "bf16",
                                                                  (3072, 768, 65536))]
  assert len(fc) == 2 and {round(g.compress_ms, 2) for g in fc} == {6.12, 6.18}


def test_every_finished_step_row_is_read_under_its_name(tmp_path):
  """A run folder written by hand: the H100 run's rows (no `row`, no status), the GPU
  report's (`row`, a gemm_choice), a failed and a skipped row; times of one row collected."""
  rows = [{"variant": "124m", "recipe": "dense", "backend": "xla", "step_ms": 290.0},
          {"variant": "124m", "recipe": "s_ste", "backend": "cusparselt", "error": "boom"},
          {"section": "steps", "row": "124m hu2024 cusparselt gemm_choice=forward",
           "status": "ok", "variant": "124m", "recipe": "hu2024", "backend": "cusparselt",
           "gemm_choice": "forward", "step_ms": 271.5},
          {"section": "steps", "row": "350m dense xla", "status": "skipped",
           "variant": "350m", "recipe": "dense", "backend": "xla"}]
  (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  (tmp_path / "b.jsonl").write_text(json.dumps(rows[0] | {"step_ms": 294.0}) + "\n")
  assert cal.measured_steps(tmp_path) == {
      "124m dense xla": [290.0, 294.0], "124m hu2024 cusparselt gemm_choice=forward": [271.5]}
  assert cal.row_name({"variant": "1558m/2", "recipe": "hu2024", "backend": "cusparselt",
                       "gemm_choice": "forward+dgrad+wgrad"}) == (
      "1558m/2 hu2024 cusparselt gemm_choice=forward+dgrad+wgrad")


def test_a_calibration_that_misses_or_adds_a_row_is_refused():
  calibration = cal.load_calibration()
  key = "h200-2026-11-27/124m s_ste xla"
  missing = {k: v for k, v in calibration.items() if k != key}
  with pytest.raises(cal.errors.UserError, match=f"no census of the measured row '{key}'"):
    cal.calibration_rows(missing)
  extra = calibration | {"h200-2026-11-27/124m s_ste pallas": calibration[key]}
  with pytest.raises(cal.errors.UserError, match="124m s_ste pallas"):
    cal.calibration_rows(extra)


def test_every_measured_row_of_every_run_is_in_the_calibration():
  """Each run's timed step rows, counted here from its raw files by their own fields, each
  with a census; the fit is per device."""
  fits = cli.calibrate()
  assert list(fits) == [r.device for r in cal.RUNS]
  for run in cal.RUNS:
    names = set()
    for path in run.path.glob("*.jsonl"):
      for line in path.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if isinstance(r.get("step_ms"), float) and r.get("status") in (None, "ok"):
          names.add(r.get("row") or f"{r['variant']} {r['recipe']} {r['backend']}")
    assert {m.row.name for m in fits[run.device].rows} == names
  assert len(fits["NVIDIA H100 80GB HBM3"].rows) == 5 and len(fits["NVIDIA H200"].rows) == 11


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


def test_the_committed_predictions_come_from_the_committed_calibration():
  """docs/step_model_predictions.json's constants and errors per device are what the model
  fits now to docs/step_model_calibration.json and the runs' step times (regenerate with
  `predict`: docs/scaling.md), and it covers every predicted row and arm on every device."""
  with open(os.path.join(REPO, "docs", "step_model_predictions.json"), encoding="utf-8") as f:
    saved = json.load(f)
  assert saved["format"] == predict.FORMAT and "PREDICTIONS" in saved["what"]
  assert saved["inputs"]["files"]["docs/step_model_calibration.json"] == hashlib.sha256(
      cal.CALIBRATION.read_bytes()).hexdigest()
  fits = cli.calibrate()
  assert list(saved["devices"]) == list(fits)
  for device, fit in fits.items():
    entry = saved["devices"][device]
    for field in ("flops_per_s", "bytes_per_s"):
      assert math.isclose(getattr(fit.constants, field), entry["constants"][field], rel_tol=1e-3)
    assert abs(fit.constants.launch_s - entry["constants"]["launch_s"]) < 1e-7
    assert [r["row"] for r in entry["rows"]] == [m.row.name for m in fit.rows]
    for row, model, loo in zip(entry["rows"], fit.model_s, fit.loo_s):
      assert math.isclose(row["model_ms"], 1e3 * model, rel_tol=1e-3)
      assert math.isclose(row["loo_model_ms"], 1e3 * loo, rel_tol=1e-3)
  got = {(r["name"], r["recipe"], r["backend"], r["device"]) for r in saved["rows"]}
  assert got == {(p[0], recipe, backend, device) for p in predict.PREDICTIONS
                 for recipe, backend in predict.ARMS for device in fits}


TINY = ("model.num_layers=1", "model.d_model=64", "model.num_heads=2", "model.seq_len=64",
        "model.vocab_size=256")


@pytest.mark.aot
def test_predict_is_a_function_of_the_code_and_the_calibration(tmp_path, capsys):
  """`predict` on a tiny config, twice: the same bytes; with a calibration whose census of
  one H200 row moves twice the bytes: other constants and other step times, the rest of the
  command alike."""
  out = tmp_path / "predictions.json"
  argv = ["predict", "--out", str(out), "--config",
          os.path.join(REPO, "experiments", "gpt2_dense.py:tiny"), "--micro", "2",
          *itertools.chain.from_iterable(("--set", s) for s in TINY)]
  assert cli.main(argv) == 0
  first = out.read_bytes()
  assert cli.main(argv) == 0
  assert out.read_bytes() == first
  data = json.loads(first)
  assert [r["device"] for r in data["rows"]] == [r.device for r in cal.RUNS]
  assert all(r["step_ms"] > 0 and r["micro_batch"] == 2 for r in data["rows"])
  census = json.loads(cal.CALIBRATION.read_text())
  for k in census["rows"]["h200-2026-11-27/124m dense xla"]["kernels"]:
    k["bytes"] *= 2
  changed = tmp_path / "calibration.json"
  changed.write_text(json.dumps(census))
  assert cli.main([*argv, "--calibration", str(changed)]) == 0
  other = json.loads(out.read_bytes())
  h100, h200 = (r.device for r in cal.RUNS)
  assert other["devices"][h100] == data["devices"][h100]     # its rows are unchanged
  assert other["devices"][h200]["constants"] != data["devices"][h200]["constants"]
  assert other["rows"][1]["step_ms"] != data["rows"][1]["step_ms"]
  assert other["rows"][0] == data["rows"][0]
  capsys.readouterr()
