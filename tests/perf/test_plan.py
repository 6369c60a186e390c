"""Tests for s24jax/perf/plan.py: the planner compiles the real step for an H100 without one
(deviceless, the `aot` marker: skipped without the CUDA compile plugin) and reports its
memory; the references are XLA's own buffer figures (the total is arguments + outputs -
aliased + temporaries), 6 N tokens for the FLOPs, and a copy of the H100 shrunk to half of
the step's need, which must not fit and must report the true need. Its command line: every
argument and config check one line and exit 2, before the compile plugin is looked for."""
import json
import os
import subprocess
import sys

import pytest

import faults

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.aot
def test_planner_reports_memory_and_detects_xla_rematerialization(tmp_path):
  """The planner on a small S-STE config for an H100 (deviceless); then for an H100 shrunk to
  half of that step's memory need: it must not fit, the 16x-memory copy must show the true
  need (the first compile's total), and if XLA rematerialized to squeeze under the limit the
  planner must say so."""
  code = r"""
import json, sys
from s24jax import config_files
from s24jax.perf import plan
from s24jax.kernels import aot
aot.start()
cfg = config_files.load_config(sys.argv[1], {"model.num_layers": 1, "model.num_heads": 2,
                                             "model.d_model": 64, "model.vocab_size": 512})
real = plan.plan(cfg, "h100", 1, search=False)
small = real["total_bytes_per_device"] // 2
plan.device_memory = lambda gpu: small
orig = plan._target_with_memory
plan._target_with_memory = lambda gpu, f: orig(gpu, 1).replace(
    "device_memory_size: 84978434048", f"device_memory_size: {small * f}")
tight = plan.plan(cfg, "h100", 1, search=True)
json.dump({"real": real, "tight": tight}, open(sys.argv[2], "w"))
"""
  out = tmp_path / "plans.json"
  subprocess.run([sys.executable, "-c", code,
                  os.path.join(REPO, "experiments", "gpt2_s_ste.py") + ":tiny", str(out)],
                 check=True, cwd=REPO, timeout=1200)
  r = json.loads(out.read_text())
  real, tight = r["real"], r["tight"]
  for key in ("fits", "total_bytes_per_device", "xla_rematerialized", "global_batch_tokens",
              "micro_batch", "grad_accum_steps", "flops_per_step"):
    assert key in real, key
  assert real["fits"] and not real["xla_rematerialized"]
  assert real["global_batch_tokens"] == 16 * 64 and real["micro_batch"] == 16
  assert real["grad_accum_steps"] == 1
  assert real["total_bytes_per_device"] == (real["argument_size_in_bytes"]
                                           + real["output_size_in_bytes"]
                                           - real["alias_size_in_bytes"]
                                           + real["temp_size_in_bytes"])
  # the forward/backward matmuls: about 6 N tokens (here the 64-wide head and attention too)
  assert 0.8 < real["flops_per_step"] / (6 * real["params"] * 1024) < 3.0
  assert not tight["fits"]
  assert tight["total_bytes_without_xla_remat"] == real["total_bytes_per_device"]
  if tight["xla_rematerialized"]:
    assert tight["total_bytes_per_device"] < tight["total_bytes_without_xla_remat"]
  best = tight["largest_fitting_micro_batch"]
  assert best is None or best < 16


@pytest.mark.slow
@pytest.mark.aot
def test_planner_reports_each_sparse_gemms_kernel_from_a_table(tmp_path):
  """The tiny Hu et al. recipe with cusparselt for one H100 (deviceless) and a table that
  marks only mlp/fc's forward faster than dense (kernel 0.1 + compression 0.2 ms against
  0.5 ms: it saves 0.2 ms per call) and mlp/proj's dX slower: the report says so per layer
  and GEMM (the GEMMs without a row run dense, nothing being measurable here), and the
  compiled step holds exactly fc's forward on cuSPARSELt: one product in each of the 2 blocks
  (unrolled, no remat, one micro-batch), W~ compressed by s24jax (no library call: the
  operand is on the H100 layout's tiles, kernels/cusparselt/layout.py)."""
  from s24jax.kernels.cusparselt import library   # pylint: disable=g-import-not-at-top
  try:
    library.toolchain()
  except library.Unavailable as e:
    pytest.skip(str(e))
  # The tiny variant: width 128, FFN 512, 16 x 64 = 1024 tokens per micro-batch; the rows
  # keyed as docs/backends.md lays the GEMMs out (forward TN: m = out, n = tokens, k = in;
  # dX TN on W~^T, s24jax compressing it: m = in, n = tokens, k = out), bf16 (the planner's
  # compute dtype).
  bf16 = {"a_type": "bf16", "b_type": "bf16", "d_type": "bf16", "d_order": "col"}
  rows = [{"gemm": "forward", "m": 512, "n": 1024, "k": 128, "layout": "TN", **bf16,
           "sparse_ms": 0.1, "compress_ms": 0.2, "dense_ms": 0.5},
          {"gemm": "dgrad", "m": 512, "n": 1024, "k": 128, "layout": "TN", **bf16,
           "sparse_ms": 0.4, "compress_ms": 0.2, "dense_ms": 0.5}]
  table = tmp_path / "table.json"
  table.write_text(json.dumps({"format": "s24jax.gemm_times/1", "rows": rows}))
  out = tmp_path / "reports" / "plan.json"   # a folder that does not exist yet: made
  run = subprocess.run([sys.executable, "-m", "s24jax.perf.plan", "--config",
                        "experiments/gpt2_t_sr_ste_df.py:tiny", "--gpu", "h100", "--no-search",
                        "--set", "sparsity.backend=cusparselt", "--set",
                        f"sparsity.gemm_table={table}", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, S24JAX_CACHE=str(tmp_path / "cache")))
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r["gemm_choice"] == "measured"
  got = {(c["layer"], c["gemm"]): c for c in r["gemm_choices"]}
  assert set(got) == {(f"h_{i}/mlp/{m}", g) for i in (0, 1) for m in ("fc", "proj")
                      for g in ("forward", "dgrad", "wgrad")}
  for (layer, gemm), c in got.items():
    fc_forward = layer.endswith("fc") and gemm == "forward"
    assert c["sparse"] == fc_forward, c
    if fc_forward:
      assert c["reason"] == "measured faster" and c["calls_per_step"] == 1, c
      assert c["saving_ms_per_call"] == pytest.approx(0.5 - (0.1 + 0.2))
    elif layer.endswith("proj") and gemm == "dgrad":
      assert c["reason"] == "measured slower" and c["saving_ms_per_call"] == 0.0, c
    else:
      assert c["reason"] == "nothing measured for it here", c
  assert r["cusparselt_custom_calls"] == 2 and r["cusparselt_rule_violations"] == 0
  assert {c["target"] for c in r["cusparselt_calls"]} == {"cusparselt_spmm"}
  assert "h_0/mlp/fc (x1, W~ 512x128, 1024 tokens) forward: 2:4 kernel" in run.stdout


# ---------------------------------------------------------------------------------------------
# The command line (in process: nothing is compiled; the compile plugin is made to be missing,
# so a check that came after it would be hidden behind its error).


def _plan(argv, capsys):
  """(exit code, stderr) of `python -m s24jax.perf.plan argv`: a return or argparse's exit."""
  from s24jax.perf import plan   # pylint: disable=g-import-not-at-top
  try:
    code = plan.main(argv)
  except SystemExit as e:
    code = e.code
  return code, capsys.readouterr().err


@pytest.fixture
def no_plugin(monkeypatch):
  """aot.start as without the CUDA compile plugin (its message: 'PLUGIN MISSING')."""
  from s24jax.perf import plan   # pylint: disable=g-import-not-at-top
  def start():
    raise plan.aot.PluginMissing("PLUGIN MISSING")
  monkeypatch.setattr(plan.aot, "start", start)


TINY_HU = os.path.join(REPO, "experiments", "gpt2_t_sr_ste_df.py") + ":tiny"


@pytest.mark.parametrize("sets, words", [
    (["sparsity.sparse_layers=('*/nope/*',)"], ["'*/nope/*'", "match no layer"]),
    (["model.d_model=66"], ["model.d_model=66"]),
    (["sparsity.backend=cusparselt", "sparsity.gemm_table=TABLE"],
     ["sparsity.gemm_table", "table.json", "s24jax/sparse_ops/gemm_times.py, TABLE_FORMAT"]),
    ([], ["PLUGIN MISSING"]),      # a good config: then the plugin's error
])
def test_every_config_check_comes_before_the_compile_plugin(sets, words, tmp_path, capsys,
                                                            no_plugin):
  table = tmp_path / "table.json"   # another format: a plan report
  table.write_text(json.dumps({"fits": True, "gpu": "h100"}))
  argv = ["--config", TINY_HU, "--no-search"]
  for s in sets:
    argv += ["--set", s.replace("TABLE", str(table))]
  code, err = _plan(argv, capsys)
  assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
  assert all(w in err for w in words), err
  assert ("PLUGIN MISSING" in err) == (not sets), err
  with open(os.path.join(REPO, "s24jax", "sparse_ops", "gemm_times.py"), encoding="utf-8") as f:
    assert "\nTABLE_FORMAT = " in f.read()   # the file the message names defines the format


@pytest.mark.parametrize("argv, words", [
    (["--gpu", "h900"], ["--gpu", "invalid choice: 'h900'"]),
    (["--devices", "0"], ["--devices", "0 is below the minimum, 1"]),
    (["--micro", "-2"], ["--micro", "-2 is below the minimum, 1"]),
    (["--headroom", "1"], ["--headroom", "must be below 1"]),
    (["--headroom", "nan"], ["--headroom", "not a finite number"]),
    (["--headroom", "-0.1"], ["--headroom", "below the minimum, 0"]),
    (["--json", "NOTES"], ["--json", "exists and is not a plan report"]),
    (["--json", "FOLDER"], ["--json", "is a folder"]),
])
def test_a_bad_argument_is_one_line_and_2_before_the_config(argv, words, tmp_path, capsys,
                                                            no_plugin):
  (tmp_path / "notes.json").write_text('{"mine": 1}')
  argv = [a.replace("NOTES", str(tmp_path / "notes.json")).replace("FOLDER", str(tmp_path))
          for a in argv]
  before = faults.snapshot(tmp_path)
  code, err = _plan(["--config", TINY_HU, *argv], capsys)
  assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
  assert all(w in err for w in words) and "PLUGIN" not in err, err
  assert faults.snapshot(tmp_path) == before


def test_the_gemm_time_cache_is_named_as_the_cache(tmp_path, monkeypatch):
  """gemm_times' errors name a file by its role: the table the config names, or this
  machine's cache of measurements (the same format)."""
  from s24jax.sparse_ops import gemm_times   # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("S24JAX_CACHE", str(tmp_path))
  for path, role in ((tmp_path / "t.json", "sparsity.gemm_table"),
                     (gemm_times.cache_file(), "the GEMM time cache")):
    with pytest.raises(ValueError, match=f"^{role} '{path}': not a JSON object"):
      gemm_times.parse_rows([], path)
