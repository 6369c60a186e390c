"""Tests for s24jax/training/model_schedule.py: dense fine-tuning switches the model at the step the fraction
names (through the loop: the logged phase and the flip rate per step), and entering it keeps
the latent W or writes the projected W~, which is checked against S-STE's soft threshold
written out here in jnp (beta * S(W), S per group of 4: sign(w) max(|w| - t, 0), t the
second smallest |w|)."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.training import loop
from s24jax.training import model_schedule
from s24jax import state as state_lib
from s24jax.training.run_spec import RunSpec

from tiny import tiny_config


@pytest.mark.slow
def test_dense_finetuning_switches_phase_and_starts_from_projected_weights(tmp_path, data_cache):
  cfg = tiny_config("ste", steps=4, workdir_cache=data_cache,
                    overrides={"sparsity.dense_finetune_fraction": 0.5})
  workdir = str(tmp_path)
  loop.train_and_evaluate(cfg, workdir)
  recs = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  phase = {r["step"]: r["train/dense_phase"] for r in recs if "train/dense_phase" in r}
  assert phase == {1: 0.0, 2: 0.0, 3: 1.0, 4: 1.0}
  flips = {r["step"] for r in recs if "train/flip_rate" in r}
  assert flips == {1, 2}                                   # no mask in the dense phase


def test_entering_dense_finetuning_projected_or_latent():
  spec = RunSpec.build(tiny_config("s_ste"))
  model_cfg = spec.model_cfg
  st = spec.fresh_state(0)
  # 'latent' (the default, the reference code's): the dense phase continues from W itself.
  assert model_cfg.dense_twin().sparsity.dense_finetune_init == "latent"
  assert model_schedule.enter(st, model_cfg, model_cfg.dense_twin()) is st
  dense = model_cfg.dense_twin()
  dense = dataclasses.replace(dense, sparsity=dataclasses.replace(
      dense.sparsity, dense_finetune_init="projected"))
  projected = model_schedule.enter(st, model_cfg, dense).params
  for path in state_lib.sparse_layer_paths(st.sparsity):
    kernel = state_lib.get_path(st.params, path)["kernel"]
    layer = state_lib.get_path(st.sparsity, path)
    want = layer["scale"] * np.asarray(                     # beta * S(W), S per group of 4
        jax.vmap(lambda g: jnp.sign(g) * jnp.maximum(jnp.abs(g) - jnp.sort(jnp.abs(g))[1], 0))(
            kernel.reshape(-1, 4))).reshape(kernel.shape)
    np.testing.assert_allclose(state_lib.get_path(projected, path)["kernel"], want, rtol=1e-6)
  np.testing.assert_array_equal(projected["wte"]["embedding"], st.params["wte"]["embedding"])
  # Moving between two sparse models (e.g. an attention window) changes nothing.
  assert model_schedule.enter(st, model_cfg, model_cfg) is st


def test_model_at_switches_at_the_fraction():
  """total 10, fraction 0.3: steps 0..6 sparse, 7..9 dense (10 - round(3)); dense runs and
  fraction 0 never switch."""
  spec = RunSpec.build(tiny_config("ste", steps=10,
                                   overrides={"sparsity.dense_finetune_fraction": 0.3}))
  assert model_schedule.dense_finetune_start(spec.facts) == 7
  sparse = [s for s in range(10)
            if model_schedule.model_at(s, spec.model_cfg, spec.facts).sparsity.method.sparse]
  assert sparse == list(range(7))
  assert model_schedule.model_at(9, spec.model_cfg, spec.facts) == spec.model_cfg.dense_twin()
  plain = RunSpec.build(tiny_config("ste", steps=10))
  assert all(model_schedule.model_at(s, plain.model_cfg, plain.facts) == plain.model_cfg
             for s in range(10))
  dense = RunSpec.build(tiny_config("dense", steps=10,
                                    overrides={"sparsity.dense_finetune_fraction": 0.3}))
  assert all(model_schedule.model_at(s, dense.model_cfg, dense.facts) == dense.model_cfg
             for s in range(10))
