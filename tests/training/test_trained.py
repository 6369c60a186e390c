"""Tests for s24jax/training/trained.py: a finished run read back read-only, and the weights its model
computes with. References: the run's own model (its sparse layers projecting inside the
forward pass) against the dense model of `computed_params`; the phases' model of a step
(s24jax/training/model_schedule.py); the session's trained workdir, whose digest the fixture checks."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.nn import model as model_lib
from s24jax.training import model_schedule
from s24jax.training import trained as trained_lib
from s24jax.training.run_spec import RunSpec

from tiny import tiny_config

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")


def _perturbed_state(method, overrides=None, steps=6):
  spec = RunSpec.build(tiny_config(method, steps=steps, overrides=overrides or {}))
  state = jax.jit(spec.fresh_state)()
  leaves, treedef = jax.tree.flatten(state.params)
  keys = jax.random.split(jax.random.PRNGKey(3), len(leaves))
  params = jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape)
                                        for x, k in zip(leaves, keys)])
  return spec, params, state.sparsity


@pytest.mark.parametrize("method, overrides", [
    ("s_ste", {"model.scan_layers": True}), ("t_sr_ste", {}),
    ("ste", {"sparsity.sparse_layers": ("*/mlp/*", "wte")}),      # a sparse tied head
    ("mst", {}),
])
def test_computed_params_in_the_dense_model_give_the_run_models_logits(method, overrides):
  """The dense twin with W~ = project(W) written into the params computes what the run's
  model computes with its sparse layers projecting inside the forward pass."""
  spec, params, sparsity = _perturbed_state(method, overrides)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50257, (2, 16)))
  cfg = spec.model_cfg
  ours = model_lib.build(cfg).apply({"params": params, "sparsity": sparsity}, tokens)
  weights = trained_lib.computed_params(cfg, params, sparsity)
  dense = model_lib.build(trained_lib.dense_config(cfg)).apply({"params": weights}, tokens)
  np.testing.assert_allclose(np.asarray(dense), np.asarray(ours), atol=2e-5, rtol=0)
  if method != "mst":   # 2:4 in every group of 4 along `in`
    fc = np.asarray(weights["h" if cfg.scan_layers else "h_0"]["mlp"]["fc"]["kernel"])
    assert ((fc.reshape(-1, 4) == 0).sum(-1) >= 2).all()


def test_dense_finetune_steps_are_the_dense_weights():
  spec, params, sparsity = _perturbed_state("ste", {"sparsity.dense_finetune_fraction": 0.5},
                                            steps=10)
  late = model_schedule.model_at(7, spec.model_cfg, spec.facts)
  assert not late.sparsity.method.sparse
  weights = trained_lib.computed_params(late, params, sparsity)
  for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  trained = trained_lib.Trained("w", 8, spec, late, params, sparsity)
  assert "dense W of dense fine-tuning (steps >= 5 of ste" in trained_lib.weights_statement(
      trained)


def test_load_run_reads_the_workdir_without_writing(undisturbed):
  """The fixture checks the workdir's digest at the end of the session."""
  latest = trained_lib.load_run(undisturbed)
  first = trained_lib.load_run(undisturbed, step=0)
  assert (latest.step, first.step) == (24, 0)
  assert latest.spec.method.name == "s_ste" and latest.tokenizer == "gpt2"
  kernel = lambda t: np.asarray(t.params["h_0"]["mlp"]["fc"]["kernel"])
  assert not np.array_equal(kernel(latest), kernel(first))
  assert "beta * S(W)" in trained_lib.weights_statement(latest)
  config = json.load(open(f"{undisturbed}/config.json"))
  assert latest.spec.config.total_steps == config["total_steps"]


def test_load_run_errors(undisturbed, tmp_path):
  with pytest.raises(trained_lib.RunError, match="no such workdir"):
    trained_lib.load_run(str(tmp_path / "none"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(trained_lib.RunError, match="no config.json"):
    trained_lib.load_run(str(tmp_path / "empty"))
  with pytest.raises(trained_lib.RunError, match="no checkpoint of step 5; it has steps 0, 24"):
    trained_lib.load_run(undisturbed, step=5)
  workdir = tmp_path / "run"
  shutil.copytree(undisturbed, workdir, ignore=shutil.ignore_patterns("checkpoints"))
  with pytest.raises(trained_lib.RunError, match="no checkpoints folder"):
    trained_lib.load_run(str(workdir))
  assert not (workdir / "checkpoints").exists()


def test_load_run_refuses_a_checkpoint_of_another_config(undisturbed, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(undisturbed, workdir)
  config = json.loads((workdir / "config.json").read_text())
  config["model"]["d_model"] = 64
  (workdir / "config.json").write_text(json.dumps(config))
  with pytest.raises(trained_lib.RunError, match="does not match the workdir's config.json"):
    trained_lib.load_run(str(workdir))
