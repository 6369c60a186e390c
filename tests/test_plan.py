"""Tests for s24jax/plan.py: the planner compiles the real step for an H100 without one
(deviceless, the `aot` marker: skipped without the CUDA compile plugin) and reports its
memory; the references are XLA's own buffer figures (the total is arguments + outputs -
aliased + temporaries), 6 N tokens for the FLOPs, and a copy of the H100 shrunk to half of
the step's need, which must not fit and must report the true need."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.aot
def test_planner_reports_memory_and_detects_xla_rematerialization(tmp_path):
  """The planner on a small S-STE config for an H100 (deviceless); then for an H100 shrunk to
  half of that step's memory need: it must not fit, the 16x-memory copy must show the true
  need (the first compile's total), and if XLA rematerialized to squeeze under the limit the
  planner must say so."""
  code = r"""
import json, sys
from s24jax import config_files, plan
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
