"""Tests for s24jax/training/run_spec.py: `RunSpec.build` builds and configures the method once (calls
counted by monkeypatching the registry and the method's `configure`), its abstract state has
the shapes and dtypes of a real fresh state, and its kernel and sparse-layer shapes are those
of the real parameters (written out by hand for the tiny GPT-2: width 32, 4 x 32 FFN, 50304
tokens)."""
import jax
import numpy as np
import pytest

from s24jax.training import flops
from s24jax.nn import model as model_lib
from s24jax.training import train
from s24jax.methods import base
from s24jax.methods import registry
from s24jax.methods import sr_ste
from s24jax.training.run_spec import RunSpec

from tiny import tiny_config


def _shapes(tree):
  return jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), tree)


def test_build_configures_the_method_once(monkeypatch):
  calls = {"from_config": 0, "configure": 0}
  real_from_config = registry.from_config
  real_configure = sr_ste.SRSTE.configure

  def counting_from_config(*args, **kwargs):
    calls["from_config"] += 1
    return real_from_config(*args, **kwargs)

  def counting_configure(self, facts):
    calls["configure"] += 1
    return real_configure(self, facts)

  monkeypatch.setattr(registry, "from_config", counting_from_config)
  monkeypatch.setattr(sr_ste.SRSTE, "configure", counting_configure)
  cfg = tiny_config("sr_ste", steps=8, overrides={"sparsity.sr_ste.decay": 1e-2,
                                                  "sparsity.sr_ste.decay_auto": True,
                                                  "optim.warmup_steps": 4})
  spec = RunSpec.build(cfg)
  assert calls == {"from_config": 1, "configure": 1}
  # the configured method is the one the model closes over; its run-dependent default is
  # resolved from the facts (decay_auto_steps 0 -> optim.warmup_steps)
  assert spec.model_cfg.sparsity.method is spec.method
  assert spec.method.decay_auto_steps == 4 and spec.facts.warmup_steps == 4
  assert spec.facts == base.RunFacts.from_config(cfg)
  assert spec.facts.total_steps == 8
  # what the loop does with the spec next builds nothing again
  state = spec.fresh_state(0)
  spec.tx(state.params, state.sparsity)
  spec.tx_fn(state.params, state.sparsity)
  _ = spec.abstract_state, spec.kernel_shapes, spec.sparse_shapes
  flops.planned(spec)
  assert calls == {"from_config": 1, "configure": 1}


@pytest.mark.parametrize("method", ["s_ste", "dense"])
def test_abstract_state_has_the_shapes_of_a_fresh_state(method):
  spec = RunSpec.build(tiny_config(method))
  real = spec.fresh_state(0)
  assert jax.tree.structure(spec.abstract_state) == jax.tree.structure(real)
  assert _shapes(spec.abstract_state) == _shapes(real)
  for leaf in jax.tree.leaves(spec.abstract_state):
    assert isinstance(leaf, jax.ShapeDtypeStruct)   # abstract: nothing allocated
  # and the same as the state built the long way, without the spec
  model = model_lib.GPT2(model_lib.model_config(spec.config))
  other = train.fresh_state(model, spec.tx, 0)
  assert _shapes(other) == _shapes(real)


def test_fresh_state_is_seeded_and_traceable():
  cfg = tiny_config("s_ste", overrides={"seed": 3})
  spec = RunSpec.build(cfg)
  default = spec.fresh_state()                       # seed None: config.seed
  three = spec.fresh_state(3)
  for a, b in zip(jax.tree.leaves(default.params), jax.tree.leaves(three.params)):
    np.testing.assert_array_equal(a, b)
  other = spec.fresh_state(4)
  fc = lambda s: np.asarray(s.params["h_0"]["mlp"]["fc"]["kernel"])   # pylint: disable=unnecessary-lambda-assignment
  assert not np.array_equal(fc(other), fc(three))
  jitted = jax.jit(spec.fresh_state)()
  for a, b in zip(jax.tree.leaves(jitted.params), jax.tree.leaves(three.params)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_kernel_and_sparse_shapes_match_the_params():
  C, H, V = 32, 128, 50304                           # tiny_config: width 32, mlp_ratio 4
  spec = RunSpec.build(tiny_config("s_ste", overrides={
      "sparsity.sparse_layers": ("*/mlp/*", "wte")}))
  assert spec.kernel_shapes == {"h_0/attn/qkv": (3 * C, C), "h_0/attn/out": (C, C),
                                "h_0/mlp/fc": (H, C), "h_0/mlp/proj": (C, H)}
  assert spec.sparse_shapes == {"h_0/mlp/fc": (H, C), "h_0/mlp/proj": (C, H), "wte": (V, C)}
  # against the real parameters
  state = spec.fresh_state(0)
  for name, shape in spec.kernel_shapes.items():
    node = state.params
    for part in name.split("/"):
      node = node[part]
    assert tuple(node["kernel"].shape) == shape, name
  assert state.params["wte"]["embedding"].shape == spec.sparse_shapes["wte"]
  for name in spec.sparse_shapes:
    node = state.sparsity
    for part in name.split("/"):
      node = node[part]
    assert tuple(node["mask"].shape) == spec.sparse_shapes[name], name
  # the default sparse layers: the FFN only; a dense run has none
  assert set(RunSpec.build(tiny_config("ste")).sparse_shapes) == {"h_0/mlp/fc", "h_0/mlp/proj"}
  assert RunSpec.build(tiny_config("dense")).sparse_shapes == {}


def test_scanned_kernels_count_their_layers():
  spec = RunSpec.build(tiny_config("ste", overrides={"model.num_layers": 3,
                                                     "model.scan_layers": True}))
  shapes = spec.kernel_shapes
  assert shapes["h/mlp/fc"] == (3 * 128, 32)         # (L, out, in) counts as (L * out, in)
  assert spec.model_cfg.scan_layers and spec.sparse_shapes == {
      "h/mlp/fc": (3, 128, 32), "h/mlp/proj": (3, 32, 128)}
