"""Tests for s24jax/methods/registry.py: name -> method, register_method / register_projection,
from_config (a method's config block, validated and configured), the renamed key.

A method defined in this file (`CountingNof4`, N:4 with a per-layer counter and a host chore)
trains by name through the generic step and loop; what the run stores (its masks, its counter,
the steps its chore ran) is checked against values counted here, not read back from the
library's bookkeeping. Errors are matched on the text a user sees.
"""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax import chores as chores_lib
from s24jax.training import config as config_lib
from s24jax.training import loop
from s24jax import state as state_lib
from s24jax.kernels import masks
from s24jax.methods import base
from s24jax.methods import registry

from tiny import tiny_config

from method_helpers import rand


@jax.custom_vjp
def _keep_n_of_4(w, n_kept):
  return jnp.where(n_kept, w, 0)


_keep_n_of_4.defvjp(lambda w, m: (_keep_n_of_4(w, m), None), lambda _, g: (g, None))


@dataclasses.dataclass(frozen=True)
class CountingNof4(base.Method):
  """N:4 hard threshold, straight-through, with a per-layer counter of refreshes (state that
  `update` changes) and a host chore that records when it ran."""
  n: int = 2                       # a hyper-parameter: config.sparsity.<name>.n
  seen: list = dataclasses.field(default_factory=list, compare=False, hash=False,
                                 metadata=base.INTERNAL)

  def __post_init__(self):
    if not 1 <= self.n <= 4:
      raise ValueError(f"n must be in 1..4, got {self.n}")

  def init_layer(self, kernel):
    return {"updates": jnp.zeros((), jnp.int32), **super().init_layer(kernel)}

  def mask(self, kernel, layer):
    return masks.nm_mask(kernel, self.n, 4)

  def project(self, kernel, layer):
    return _keep_n_of_4(kernel, layer["mask"])

  def update(self, before, after, grads, info):
    after, metrics = super().update(before, after, grads, info)
    sparsity = after.sparsity
    paths = state_lib.sparse_layer_paths(sparsity)
    return after.replace(sparsity=state_lib.with_layer_entry(
        sparsity, "updates", {p: base.layer_at(sparsity, p)["updates"] + 1 for p in paths})
    ), metrics

  def chores(self, facts):
    return [*super().chores(facts),
            chores_lib.Chore(lambda ctx: self.seen.append(ctx.info.next_step), every=2,
                             name="count")]


@pytest.fixture
def counting_method():
  name = "test_counting_n_of_4"
  method = registry.register_method(name, CountingNof4())
  try:
    yield method
  finally:
    registry._REGISTRY.pop(name, None)   # pylint: disable=protected-access


@pytest.mark.slow
def test_a_method_defined_in_a_test_trains_by_name(counting_method, tmp_path, data_cache):
  name = counting_method.name
  cfg = tiny_config(name, steps=4, workdir_cache=data_cache)
  assert cfg.sparsity[name].n == 2           # its block is in the base config
  cfg.sparsity[name].n = 1                   # ... and overridable like any field
  final = loop.train_and_evaluate(cfg, str(tmp_path))
  assert np.isfinite(final["val/loss"])
  assert counting_method.seen == [2, 4]       # its host chore ran every 2 steps, the instance
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  updates = {r["step"]: r["train/method/updates"] for r in records
             if "train/method/updates" in r}
  assert updates == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}   # update changed its state
  flips = [r["train/flip_rate"] for r in records if "train/flip_rate" in r]
  assert len(flips) == 4 and all(0 <= f <= 1 for f in flips)
  # n = 1 reached the forward pass: the stored masks keep exactly one of every 4.
  from s24jax.training import checkpoint as ckpt_lib   # pylint: disable=g-import-not-at-top
  from s24jax.training.run_spec import RunSpec   # pylint: disable=g-import-not-at-top
  spec = RunSpec.build(cfg)
  assert spec.method.n == 1
  fresh = spec.fresh_state(0)
  state = ckpt_lib.Checkpointer(str(tmp_path)).restore_or_init(fresh)
  mask = np.asarray(state.sparsity["h_0"]["mlp"]["fc"]["mask"])
  assert (mask.reshape(-1, 4).sum(1) == 1).all()
  assert int(state.sparsity["h_0"]["mlp"]["fc"]["updates"]) == 4


def test_registry_errors_list_the_valid_choices(counting_method):
  with pytest.raises(ValueError, match="already registered"):
    registry.register_method("ste", CountingNof4())
  with pytest.raises(ValueError) as e:
    registry.get_method("s-ste")
  for name in ("dense", "ste", "sr_ste", "t_sr_ste", "s_ste", "mst", counting_method.name):
    assert name in str(e.value)
  cfg = tiny_config(counting_method.name)
  cfg.sparsity[counting_method.name]["m"] = 8
  with pytest.raises(ValueError, match=r"unknown fields \['m'\].*valid: \['n'\]"):
    registry.from_config(cfg)
  cfg = tiny_config(counting_method.name)
  cfg.sparsity[counting_method.name].n = 5
  with pytest.raises(ValueError, match="n must be in 1..4"):   # the method validates itself
    registry.from_config(cfg)


def test_every_builtin_method_owns_its_config_block():
  c = config_lib.base_config()
  assert set(c.sparsity.t_sr_ste) >= {"mask_refresh_every", "decay", "decay_auto"}
  assert set(c.sparsity.s_ste) == {"rescale_every"}
  assert "update_every" in c.sparsity.mst
  c.sparsity.method = "sr_ste"
  c.sparsity.sr_ste.decay_placement = "sideways"
  with pytest.raises(ValueError, match="decay_placement.*valid: gradients, weights, backward"):
    registry.from_config(c)
  c = tiny_config("mst", overrides={"sparsity.backend": "pallas"})
  with pytest.raises(ValueError, match="needs sparsity.backend='xla'"):
    registry.from_config(c)


def test_the_old_method_key_is_an_error_naming_the_new_one():
  cfg = tiny_config("ste")
  cfg.sparsity.projection = "s_ste"   # an experiment file written before the rename
  with pytest.raises(ValueError, match=r"renamed to config.sparsity.method.*'s_ste'"):
    registry.from_config(cfg)


def test_unknown_projection_lists_valid_names():
  with pytest.raises(ValueError) as e:
    registry.get_method("s-ste")
  for name in ("dense", "ste", "sr_ste", "s_ste"):
    assert name in str(e.value)


def test_register_plain_function_and_protect_builtins():
  @jax.custom_vjp
  def half(w):
    return jnp.where(masks.nm_mask(w, 1, 4), w, 0)   # 1:4, hard

  half.defvjp(lambda w: (half(w), None), lambda _, g: (g,))
  try:
    registry.register_projection("test_one_of_four", half)
    proj = registry.get_method("test_one_of_four")
    assert "test_one_of_four" in registry.available_methods()
    w = rand(6)
    y = np.asarray(proj.project(jnp.asarray(w), {}))
    assert ((y != 0).reshape(-1, 4).sum(1) == 1).all()
    np.testing.assert_array_equal(np.asarray(proj.mask(jnp.asarray(w), {})), y != 0)
    with pytest.raises(ValueError, match="already registered"):
      registry.register_projection("ste", half)
  finally:
    registry._REGISTRY.pop("test_one_of_four", None)   # pylint: disable=protected-access
