"""The method interface: a method defined here trains by name through the generic step and
loop; the registry and config blocks; the step and the loop know no method; hooks and time."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax import config as config_lib
from s24jax import hooks
from s24jax import state as state_lib
from s24jax import loop
from s24jax.kernels import masks
from s24jax.methods import base
from s24jax.methods import registry

from tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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

  def update(self, before, after, grads):
    after, metrics = super().update(before, after, grads)
    sparsity = after.sparsity
    paths = state_lib.sparse_layer_paths(sparsity)
    return after.replace(sparsity=state_lib.with_layer_entry(
        sparsity, "updates", {p: base.layer_at(sparsity, p)["updates"] + 1 for p in paths})
    ), metrics

  def chores(self, run):
    return [*super().chores(run),
            hooks.Hook(lambda ctx: self.seen.append(ctx.step), every=2, name="count")]


@pytest.fixture
def counting_method():
  name = "test_counting_n_of_4"
  method = registry.register_method(name, CountingNof4())
  try:
    yield method
  finally:
    registry._REGISTRY.pop(name, None)   # pylint: disable=protected-access


def test_a_method_defined_in_a_test_trains_by_name(counting_method, tmp_path, data_cache):
  name = counting_method.name
  cfg = tiny_config(name, steps=4, workdir_cache=data_cache)
  assert cfg.sparsity[name].n == 2           # its block is in the base config
  cfg.sparsity[name].n = 1                   # ... and overridable like any field
  final = loop.train_and_evaluate(cfg, str(tmp_path))
  assert np.isfinite(final["val/loss"])
  assert counting_method.seen == [2, 4]       # its host hook ran every 2 steps, the instance
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  updates = {r["step"]: r["train/sparsity/updates"] for r in records
             if "train/sparsity/updates" in r}
  assert updates == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}   # update changed its state
  flips = [r["train/flip_rate"] for r in records if "train/flip_rate" in r]
  assert len(flips) == 4 and all(0 <= f <= 1 for f in flips)
  # n = 1 reached the forward pass: the stored masks keep exactly one of every 4.
  from s24jax import checkpoint as ckpt_lib   # pylint: disable=g-import-not-at-top
  from s24jax import model as model_lib   # pylint: disable=g-import-not-at-top
  from s24jax import train   # pylint: disable=g-import-not-at-top
  method, model_cfg, tx_fn = loop.build(cfg)
  assert method.n == 1
  fresh = train.fresh_state(model_lib.GPT2(model_cfg), tx_fn, 0)
  state = ckpt_lib.Checkpointer(str(tmp_path)).restore_or_init(fresh)
  mask = np.asarray(state.sparsity["h_0"]["mlp"]["fc"]["mask"])
  assert (mask.reshape(-1, 4).sum(1) == 1).all()


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
  c = tiny_config("mst", sparsity__backend="pallas")
  with pytest.raises(ValueError, match="needs sparsity.backend='xla'"):
    registry.from_config(c)


def test_the_step_and_the_loop_name_no_method():
  pattern = re.compile(r"mst|decay_control|flip_monitor|act_sparsity|venom|t_sr_ste|s_ste|"
                       r"transposable|mvue")
  for name in ("train.py", "loop.py"):
    with open(os.path.join(REPO, "s24jax", name)) as f:
      hits = [(i, line) for i, line in enumerate(f, 1) if pattern.search(line)]
    assert not hits, (name, hits)


def test_config_and_model_do_not_import_the_data_pipeline():
  code = ("import sys, s24jax.model, s24jax.config; "
          "assert 'tensorflow_datasets' not in sys.modules; "
          "assert 's24jax.data' not in sys.modules and 's24jax.train' not in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_itstime():
  assert [s for s in range(1, 11) if hooks.itstime(s, 3, 10)] == [3, 6, 9, 10]
  assert [s for s in range(1, 11) if hooks.itstime(s, 0, 10)] == [10]
  assert [s for s in range(1, 11) if hooks.itstime(s, 3, 10, last=False)] == [3, 6, 9]


def test_clock_leaves_excluded_time_out(monkeypatch):
  # A fake time source: exact arithmetic, independent of how loaded the machine is.
  now = [100.0]
  monkeypatch.setattr(hooks.time, "time", lambda: now[0])
  clock = hooks.Clock()
  now[0] += 0.05                        # training
  with clock.excluded(jnp.zeros(3)):
    now[0] += 0.3                       # eval, checkpoint...
  now[0] += 0.02                        # training
  assert clock.lap() == pytest.approx(0.07)
  with clock.excluded(jnp.zeros(3)):
    now[0] += 0.1
  assert clock.lap() == pytest.approx(1e-9)   # nothing but excluded time: the floor


def test_hooks_run_when_due_and_on_their_side(monkeypatch):
  calls = []

  class FakeRun:
    step, total, state = 0, 6, jnp.zeros(())
    clock = hooks.Clock()

  run = FakeRun()
  chores = [hooks.Hook(lambda r: calls.append(("after", r.step)), every=2),
            hooks.Hook(lambda r: calls.append(("before", r.step)), before_step=True,
                       training=True, due=lambda s: s % 3 == 0)]
  for step in range(6):
    run.step = step
    hooks.run_hooks(run, chores, before_step=True)
    run.step = step + 1
    hooks.run_hooks(run, chores, before_step=False)
  assert calls == [("before", 0), ("after", 2), ("before", 3), ("after", 4), ("after", 6)]


BUILTIN = ("dense", "ste", "sr_ste", "t_sr_ste", "s_ste", "mst")


@pytest.mark.parametrize("name", BUILTIN)
def test_every_builtin_method_trains_with_the_tied_head_sparse(name, data_cache):
  """'wte' in sparse_layers (the tied embedding / LM head) works for every built-in method:
  two jitted steps, finite losses, the head's mask stored and kept 2:4 (MST: its density)."""
  from s24jax import model as model_lib   # pylint: disable=g-import-not-at-top
  from s24jax import train   # pylint: disable=g-import-not-at-top
  cfg = tiny_config(name, steps=4, workdir_cache=data_cache,
                    sparsity__sparse_layers=("*/mlp/*", "wte"))
  if name == "sr_ste":   # the masked decay reaches the head (it crashed there at step 1)
    cfg.sparsity.sr_ste.decay = 0.1
  method, model_cfg, tx_fn = loop.build(cfg)
  model = model_lib.GPT2(model_cfg)
  state = train.fresh_state(model, tx_fn, 0)
  tx = tx_fn(state.params, state.sparsity)
  vocab = state.params["wte"]["embedding"].shape[0]
  batch = {"inputs": jnp.zeros((4, 16), jnp.int32) + jnp.arange(16) % vocab,
           "targets": jnp.ones((4, 16), jnp.int32)}
  for _ in range(2):
    state, metrics = train.train_step(state, batch, model=model, tx=tx)
    assert np.isfinite(float(metrics["loss"]))
  if not method.sparse:
    assert "wte" not in state.sparsity
    return
  mask = np.asarray(state.sparsity["wte"]["mask"])
  head = np.asarray(state.params["wte"]["embedding"])
  assert mask.shape == head.shape
  if method.structured_24:
    assert (mask.reshape(-1, 4).sum(1) == 2).all()
  else:   # MST: weights outside the mask are exactly 0
    assert (head[~mask] == 0).all() and 0 < mask.mean() < 1


def test_sr_ste_forward_masks_cover_the_tied_head():
  """The masked decay's mask tree holds the head's mask at ('wte', 'embedding') (it was
  built with 'kernel' hard-coded, and None there crashed the first step)."""
  from s24jax.methods import sr_ste   # pylint: disable=g-import-not-at-top
  params = {"wte": {"embedding": jnp.ones((8, 4))},
            "h_0": {"mlp": {"fc": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(4)}}}}
  sparsity = {"wte": {"mask": jnp.eye(8, 4, dtype=bool)},
              "h_0": {"mlp": {"fc": {"mask": jnp.ones((4, 8), bool)}}}}
  tree = sr_ste.forward_masks(params, sparsity)
  np.testing.assert_array_equal(tree["wte"]["embedding"], sparsity["wte"]["mask"])
  np.testing.assert_array_equal(tree["h_0"]["mlp"]["fc"]["kernel"],
                                sparsity["h_0"]["mlp"]["fc"]["mask"])
  assert tree["h_0"]["mlp"]["fc"]["bias"] is None


def test_the_old_method_key_is_an_error_naming_the_new_one():
  cfg = tiny_config("ste")
  cfg.sparsity.projection = "s_ste"   # an experiment file written before the rename
  with pytest.raises(ValueError, match=r"renamed to config.sparsity.method.*'s_ste'"):
    registry.from_config(cfg)
