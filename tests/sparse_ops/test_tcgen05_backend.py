"""Tests of s24jax/sparse_ops/tcgen05.py, sparsity.backend='tcgen05': every 2:4 GEMM of a
sparse layer on Blackwell's sparse tensor cores (kernels/tcgen05.py).

It cannot run here (no Blackwell GPU; interpret mode has no TMEM / tcgen05). What runs in the
CPU suite: selecting it off a Blackwell GPU fails with a clear error naming the backend that
does run. With the CUDA compile plugin (`aot`): a tiny Hu et al. train step using it compiles
for a B200, and its PTX holds the sparse MMA with no spills. On a Blackwell GPU (`gpu`): the
op and a short training run against the 'xla' backend (the reference), as the Pallas tests
(tests/sparse_ops/test_pallas_backend.py) do.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from s24jax.training import train
from s24jax.kernels import tcgen05
from s24jax.nn.model import GPT2
from s24jax.training.run_spec import RunSpec

from tiny import tiny_config

from ops_helpers import SHAPES, assert_bf16_op_matches_xla, train_losses

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(backend, overrides=None):
  c = tiny_config("t_sr_ste", overrides={
      "sparsity.backend": backend, "sparsity.mvue": True,
      "sparsity.t_sr_ste.mask_refresh_every": 2, **(overrides or {})})
  c.model.vocab_size = 64
  return c


@pytest.mark.skipif(tcgen05.targets_blackwell(), reason="checks the error off Blackwell")
def test_tcgen05_off_blackwell_names_the_backend_that_runs():
  c = _config("tcgen05")
  spec = RunSpec.build(c)   # building the config is fine anywhere
  model_cfg, tx_fn = spec.model_cfg, spec.tx
  model = GPT2(model_cfg)
  state = train.fresh_state(model, tx_fn, 0)   # so is init (shapes only, no kernel)
  batch = {"inputs": jax.numpy.zeros((4, 16), jax.numpy.int32),
           "targets": jax.numpy.zeros((4, 16), jax.numpy.int32)}
  with pytest.raises(tcgen05.NotBlackwellError, match="sparsity.backend='xla'"):
    train.train_step(state, batch, model=model, tx=tx_fn(state.params, state.sparsity))


@pytest.mark.slow
@pytest.mark.aot
def test_train_step_with_tcgen05_compiles_for_b200_with_sparse_mma(tmp_path):
  code = r"""
import json, sys
from s24jax import config_files
from s24jax.perf import plan
from s24jax.kernels import aot
aot.start(sys.argv[2])
cfg = config_files.load_config(sys.argv[1], {
    "sparsity.backend": "tcgen05", "model.vocab_size": 512,
    "sparsity.t_sr_ste.mask_refresh_drift": 0.0})
report = plan.plan(cfg, "b200", 1, search=False)
kernels = [r for f in aot.ptx_files(sys.argv[2]) if "tcgen05.mma.sp" in f.read_text()
           for r in aot.ptxas_report(f, "b200")]
json.dump({"fits": report["fits"], "spills": [r.spill_bytes for r in kernels],
           "count": len(kernels)}, open(sys.argv[3], "w"))
"""
  out = tmp_path / "r.json"
  subprocess.run([sys.executable, "-c", code,
                  os.path.join(REPO, "experiments", "gpt2_t_sr_ste_df.py") + ":tiny",
                  str(tmp_path / "dump"), str(out)], check=True, cwd=REPO, timeout=1200)
  r = json.loads(out.read_text())
  assert r["fits"]
  # forward, data gradient and MVUE weight gradient of the two FFN layers use the sparse MMA
  assert r["count"] >= 3, r
  assert r["spills"] and max(r["spills"]) == 0, r


ON_BLACKWELL = pytest.mark.skipif(not tcgen05.targets_blackwell(), reason="needs a Blackwell GPU")


@pytest.mark.gpu
@ON_BLACKWELL
@pytest.mark.parametrize("tokens,out,inp", SHAPES + [(256, 3072, 768)])
def test_gpu_tcgen05_op_matches_xla(tokens, out, inp):
  assert_bf16_op_matches_xla("tcgen05", tokens, out, inp)


@pytest.mark.gpu
@ON_BLACKWELL
def test_gpu_tiny_training_with_tcgen05_matches_xla():
  def losses(backend):
    return train_losses(_config(backend, {"sparsity.mvue": False}), 5)[0]
  np.testing.assert_allclose(losses("tcgen05"), losses("xla"), rtol=2e-2)
