"""Tests for s24jax.mst (Mixed Sparsity Training): the per-layer drop-and-grow against a NumPy
reference written from the definition, Erdos-Renyi densities against a bisection, the
schedules at hand-computed points, and the whole-state update (exact counts, zeroed regrowth,
reset moments, Orbax resume) on a 1-layer GPT-2."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny import tiny_config

from s24jax import checkpoint as ckpt_lib
from s24jax import loop
from s24jax import losses
from s24jax import methods
from s24jax import model as model_lib
from s24jax.methods import mst
from s24jax import state as state_lib
from s24jax import train

# ---------------------------------------------------------------------------------------------
# One layer.


def _update_np(w, mask, grad, target, drop_frac, grad_share):
  """Reference: (dropped flat indices, gradient-grown flat indices, number grown at random)."""
  m = mask.reshape(-1)
  a, g = np.abs(w).reshape(-1), np.abs(grad).reshape(-1)
  size, n_active = m.size, int(m.sum())
  swap = int(np.floor(np.float32(drop_frac) * np.float32(n_active)))
  # Every dropped weight must be active and every grown one inactive before the update.
  swap = max(0, min(swap, n_active, target, size - n_active, size - target))
  n_drop = swap + max(n_active - target, 0)
  n_grow = swap + max(target - n_active, 0)
  n_grad = int(np.floor(np.float32(grad_share) * np.float32(n_grow) + np.float32(0.5)))
  active = np.flatnonzero(m)                                   # ascending: ties -> lower index
  dropped = active[np.argsort(a[active], kind="stable")[:n_drop]]
  inactive = np.flatnonzero(~m)
  grown = inactive[np.argsort(-g[inactive], kind="stable")[:n_grad]]
  return set(dropped.tolist()), set(grown.tolist()), n_grow - n_grad


_update_jit = jax.jit(mst.update_layer_mask)


@pytest.mark.parametrize("density,target_density,drop_frac,share", [
    (0.5, 0.5, 0.3, 0.75),     # pure swap
    (0.5, 0.2, 0.3, 0.75),     # schedule raised the sparsity: prune more than grow
    (0.2, 0.6, 0.1, 0.75),     # schedule lowered it: grow more
    (1.0, 0.3, 0.3, 0.75),     # first pruning from dense
    (0.9, 1.0, 0.3, 0.5),      # restoration to dense: nothing left to swap
    (0.4, 0.4, 0.25, 0.0),     # r = 0: all random (SET)
    (0.4, 0.4, 0.25, 1.0),     # all by gradient (RigL)
])
@pytest.mark.parametrize("ties", [False, True])
def test_update_layer_matches_numpy(density, target_density, drop_frac, share, ties):
  rng = np.random.default_rng(int(density * 100 + target_density * 10 + ties))
  shape = (12, 20)
  size = 12 * 20
  if ties:   # many exact ties in |w| and |grad|
    w = rng.integers(-3, 4, shape).astype(np.float32)
    grad = rng.integers(-2, 3, shape).astype(np.float32)
  else:
    w = rng.standard_normal(shape).astype(np.float32)
    grad = rng.standard_normal(shape).astype(np.float32)
  mask = np.zeros(size, bool)
  mask[rng.permutation(size)[:int(round(density * size))]] = True
  mask = mask.reshape(shape)
  w = np.where(mask, w, 0)   # pruned weights are 0 in training
  target = int(round(target_density * size))

  new, info = _update_jit(jnp.asarray(w), jnp.asarray(mask), jnp.asarray(grad), target,
                          drop_frac, share, jax.random.PRNGKey(3))
  new, info = np.asarray(new), {k: np.asarray(v) for k, v in info.items()}
  dropped, grown, n_random = _update_np(w, mask, grad, target, drop_frac, share)

  assert new.sum() == target                                      # exactly the target
  assert set(np.flatnonzero(info["dropped"])) == dropped          # smallest |w| of the active
  assert set(np.flatnonzero(info["grown_gradient"])) == grown     # largest |grad| of the inactive
  rand = info["grown_random"]
  assert rand.sum() == n_random
  assert not (rand & mask).any() and not (rand & info["grown_gradient"]).any()
  want = (mask & ~info["dropped"]) | info["grown_gradient"] | rand
  np.testing.assert_array_equal(new, want)
  if drop_frac > 0 and 0 < target < size and density < 1:
    assert info["dropped"].any() or info["grown_gradient"].any() or rand.any()


def test_random_growth_is_uniform_over_inactive():
  """Over many keys every inactive position is picked about equally often."""
  shape, size = (6, 8), 48
  mask = np.zeros(size, bool)
  mask[::2] = True                                                 # 24 active, 24 inactive
  mask = mask.reshape(shape)
  w = jnp.where(mask, 1.0, 0.0)
  grad = jnp.zeros(shape)
  keys = jax.random.split(jax.random.PRNGKey(0), 4000)
  f = jax.jit(jax.vmap(lambda k: mst.update_layer_mask(w, mask, grad, 24, 0.25, 0.0, k)[1]
                       ["grown_random"]))
  counts = np.asarray(f(keys)).sum(0).reshape(-1)                  # 6 grown per key
  assert counts[mask.reshape(-1)].sum() == 0
  p = 6 / 24
  expect, sd = 4000 * p, math.sqrt(4000 * p * (1 - p))
  inactive = counts[~mask.reshape(-1)]
  assert np.all(np.abs(inactive - expect) < 5 * sd), inactive


# ---------------------------------------------------------------------------------------------
# Layer densities.


def _er_bisection(shapes, density):
  """Reference: eps solving sum min(1, eps raw_l) size_l = density * total, by bisection."""
  raw = {k: (o + i) / (o * i) for k, (o, i) in shapes.items()}
  size = {k: o * i for k, (o, i) in shapes.items()}
  goal = density * sum(size.values())
  lo, hi = 0.0, 1e9
  for _ in range(200):
    mid = (lo + hi) / 2
    have = sum(min(1.0, mid * raw[k]) * size[k] for k in shapes)
    lo, hi = (mid, hi) if have < goal else (lo, mid)
  return {k: min(1.0, lo * raw[k]) for k in shapes}


@pytest.mark.parametrize("density", [0.0, 0.02, 0.1, 0.3, 0.6, 0.95, 1.0])
def test_erdos_renyi_matches_bisection(density):
  C = 64
  shapes = {"qkv": (3 * C, C), "out": (C, C), "fc": (4 * C, C), "proj": (C, 4 * C),
            "small": (8, 12)}
  got = mst.erdos_renyi_densities(shapes, density)
  want = _er_bisection(shapes, density)
  for k in shapes:
    assert got[k] == pytest.approx(want[k], abs=1e-9), k
    assert 0.0 <= got[k] <= 1.0
  total = sum(o * i for o, i in shapes.values())
  assert sum(got[k] * o * i for k, (o, i) in shapes.items()) == pytest.approx(density * total)
  if density == 0.3:   # the small layer is capped and the rest redistributed
    assert got["small"] == 1.0 and got["out"] < 1.0
  counts = mst.target_counts(shapes, 1.0 - density)
  assert abs(sum(counts.values()) - density * total) <= len(shapes) / 2


def test_uniform_and_bad_distribution():
  shapes = {"a": (4, 8), "b": (16, 8)}
  assert mst.layer_densities(shapes, 0.25, "uniform") == {"a": 0.25, "b": 0.25}
  with pytest.raises(ValueError, match="valid: erdos_renyi, uniform"):
    mst.layer_densities(shapes, 0.25, "er")


# ---------------------------------------------------------------------------------------------
# Schedules.


def _mst_cfg(**kw):
  c = tiny_config("mst", steps=1000)
  m = c.sparsity.mst
  m.initial_sparsity, m.target_sparsity = 0.0, 0.8
  m.ultra_sparsity, m.final_sparsity = 0.9, 0.5
  m.phase_fractions, m.ramp_fraction = (0.2, 0.5, 0.3), 0.5
  for k, v in kw.items():
    m[k] = v
  return c


def _method(c) -> mst.MST:
  return methods.from_config(c)


def test_sparsity_schedule_points():
  c = _mst_cfg()
  m, T = _method(c), c.total_steps
  assert mst.phase_bounds(m, T) == [(0, 200), (200, 700), (700, 1000)]
  s = lambda t: mst.target_sparsity(m, t, T)   # pylint: disable=unnecessary-lambda-assignment
  assert s(0) == 0.0
  assert s(50) == pytest.approx(0.8 * 0.5)                 # half-way up the warm-up ramp
  assert s(100) == pytest.approx(0.8) and s(199) == pytest.approx(0.8)   # hold
  assert s(200) == pytest.approx(0.8)
  assert s(325) == pytest.approx(0.85)                     # half-way up the ultra ramp
  assert s(450) == pytest.approx(0.9) and s(699) == pytest.approx(0.9)   # ultra hold
  assert s(700) == pytest.approx(0.9)
  assert s(850) == pytest.approx(0.5) and s(999) == pytest.approx(0.5)   # restoration
  vals = [s(t) for t in range(0, 100)]
  assert all(b >= a for a, b in zip(vals, vals[1:]))        # the warm-up ramp is monotone
  assert [mst.phase_at(m, t, T) for t in (0, 199, 200, 699, 700, 999, 5000)] == [0, 0, 1, 1, 2, 2, 2]


def test_drop_fraction_cosine():
  c = _mst_cfg(drop_fraction=0.3)
  m, T = _method(c), c.total_steps
  assert mst.drop_fraction(m, 0, T) == pytest.approx(0.3)
  assert mst.drop_fraction(m, 500, T) == pytest.approx(0.15)
  assert mst.drop_fraction(m, 250, T) == pytest.approx(0.15 * (1 + math.cos(math.pi / 4)))
  assert mst.drop_fraction(m, T, T) == pytest.approx(0.0)
  c = _mst_cfg(drop_fraction=0.3, anneal_per_phase=True)   # piecewise: restart per phase
  assert mst.drop_fraction(_method(c), 200, T) == pytest.approx(0.3)
  assert mst.drop_fraction(_method(c), 450, T) == pytest.approx(0.15)
  assert mst.drop_fraction(_method(c), 700, T) == pytest.approx(0.3)


def test_attention_window():
  c = _mst_cfg(sparse_attention="strided", sparse_attention_start=0.25,
               sparse_attention_end=0.5)
  m = _method(c)
  assert mst.attention_window(m, 1000) == (250, 500)
  assert [mst.attention_at(m, t, 1000, "causal") for t in (0, 249, 250, 499, 500)] == [
      "causal", "causal", "strided", "strided", "causal"]
  base_cfg = model_lib.model_config(c)
  assert [m.model_at(t, base_cfg, c).attention for t in (249, 250)] == ["causal", "strided"]
  c.sparsity.mst.sparse_attention = "causal"
  assert mst.attention_at(_method(c), 300, 1000, "causal") == "causal"


@pytest.mark.parametrize("field,value,match", [
    ("distribution", "random", "valid: erdos_renyi, uniform"),
    ("phase_fractions", (0.5, 0.6, 0.1), "summing to 1"),
    ("sparse_attention", "sliding", "valid: causal, strided, local_strided"),
    ("update_every", 0, "update_every must be an integer >= 1"),
    ("ultra_sparsity", 1.5, "ultra_sparsity must be in"),
])
def test_bad_config(field, value, match):
  c = _mst_cfg()
  c.sparsity.mst[field] = value
  with pytest.raises(ValueError, match=match):
    methods.from_config(c)


def test_unstructured_masks_need_the_xla_backend():
  c = _mst_cfg()
  c.sparsity.backend = "pallas"
  with pytest.raises(ValueError, match="needs sparsity.backend='xla'"):
    methods.from_config(c)


def test_schedule_plot(tmp_path):
  c = _mst_cfg(sparse_attention="local_strided")
  path = mst.plot_schedule(_method(c), c, str(tmp_path / "s.png"),
                           measured={"step": [0, 500], "sparsity": [0.0, 0.9]})
  assert (tmp_path / "s.png").stat().st_size > 1000 and path.endswith("s.png")


# ---------------------------------------------------------------------------------------------
# The whole train state.


@pytest.fixture(scope="module")
def setup():
  config = tiny_config("mst", steps=100)
  config.sparsity.sparse_layers = ("*/attn/*", "*/mlp/*")
  _, model_cfg, tx_fn = loop.build(config)
  model = model_lib.GPT2(model_cfg)
  state = jax.jit(lambda: train.init_state(model, tx_fn, config.seed))()
  tx = tx_fn(state.params, state.sparsity)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 1000, (4, config.model.seq_len + 1))
  batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
           "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
  return config, model, tx, state, batch


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _run(state, batch, model, targets, drop_frac, share):
  return mst.topology_update(_copy(state), batch,
                             {k: jnp.asarray(v, jnp.int32) for k, v in targets.items()},
                             jnp.float32(drop_frac), jnp.float32(share), model=model)


def test_state_update_counts_zeroing_and_moments(setup):
  config, model, _, state, batch = setup
  assert isinstance(model.config.sparsity.method, mst.MST)
  paths = state_lib.sparse_layer_paths(state.sparsity)
  assert [state_lib.layer_name(p) for p in paths] == [
      "h_0/attn/out", "h_0/attn/qkv", "h_0/mlp/fc", "h_0/mlp/proj"]
  assert all(bool(state_lib.get_path(state.sparsity, p)["mask"].all()) for p in paths)  # dense
  shapes = mst.kernel_shapes(state.params, state.sparsity)
  # Distinct non-zero moments everywhere, to see which ones the update resets.
  state = state.replace(opt_state=jax.tree.map(
      lambda x: jnp.full_like(x, 0.5) if x.ndim and jnp.issubdtype(x.dtype, jnp.floating)
      else x, state.opt_state))

  for sparsity, drop_frac in ((0.7, 0.3), (0.85, 0.2), (0.6, 0.3)):   # prune, prune, regrow
    targets = {state_lib.layer_name(p): n for p, n in mst.target_counts(shapes, sparsity).items()}
    new, metrics = _run(state, batch, model, targets, drop_frac, 0.75)
    adam = new.opt_state[1]
    for p in paths:
      name = state_lib.layer_name(p)
      old_m = np.asarray(state_lib.get_path(state.sparsity, p)["mask"])
      new_m = np.asarray(state_lib.get_path(new.sparsity, p)["mask"])
      w_old = np.asarray(state_lib.get_path(state.params, p)["kernel"])
      w_new = np.asarray(state_lib.get_path(new.params, p)["kernel"])
      assert new_m.sum() == targets[name] == int(metrics[f"mst/active/{name}"])
      dropped, grown, kept = old_m & ~new_m, new_m & ~old_m, old_m & new_m
      if dropped.any() and kept.any():     # dropped are the smallest active magnitudes
        assert np.abs(w_old[dropped]).max() <= np.abs(w_old[kept]).min()
      assert (w_new[~new_m] == 0).all()    # pruned are 0
      assert (w_new[grown] == 0).all()     # regrowth starts at 0
      np.testing.assert_array_equal(w_new[kept], w_old[kept])
      changed = old_m != new_m
      for moments in (adam.mu, adam.nu):
        v = np.asarray(state_lib.get_path(moments, p)["kernel"])
        old_v = np.asarray(state_lib.get_path(
            (state.opt_state[1].mu if moments is adam.mu else state.opt_state[1].nu), p)["kernel"])
        assert (v[changed] == 0).all()
        np.testing.assert_array_equal(v[~changed], old_v[~changed])
    # Non-masked parameters and their moments are untouched.
    np.testing.assert_array_equal(np.asarray(new.params["wte"]["embedding"]),
                                  np.asarray(state.params["wte"]["embedding"]))
    assert (np.asarray(adam.mu["wte"]["embedding"]) == 0.5).all()
    state = new


def test_gradient_growth_uses_the_dense_gradient(setup):
  """With r = inf every regrown weight is among the largest |dL/dW~| of the inactive ones;
  dL/dW~ computed independently, by a dense model evaluated at W~ = mask * W."""
  config, model, _, state, batch = setup
  shapes = mst.kernel_shapes(state.params, state.sparsity)
  targets = {state_lib.layer_name(p): n for p, n in mst.target_counts(shapes, 0.8).items()}
  state, _ = _run(state, batch, model, targets, 0.3, 0.75)          # prune to 80% first
  dense_model = model_lib.GPT2(loop.build(config)[1].dense_twin())
  w_tilde = state_lib.mask_sparse_kernels(state.params, state.sparsity)

  def loss(params):
    logits = dense_model.apply({"params": params}, batch["inputs"])
    return losses.cross_entropy_sum(logits, batch["targets"]) / batch["targets"].size

  grads = jax.jit(jax.grad(loss))(w_tilde)
  new, metrics = _run(state, batch, model, targets, 0.3, 1.0)
  assert int(metrics["mst/grown_random"]) == 0 and int(metrics["mst/grown_gradient"]) > 0
  for p in state_lib.sparse_layer_paths(state.sparsity):
    old_m = np.asarray(state_lib.get_path(state.sparsity, p)["mask"])
    new_m = np.asarray(state_lib.get_path(new.sparsity, p)["mask"])
    g = np.abs(np.asarray(state_lib.get_path(grads, p)["kernel"]))
    grown = new_m & ~old_m
    not_grown = ~old_m & ~new_m
    assert grown.any()
    assert g[grown].min() >= g[not_grown].max() * (1 - 1e-5)


def test_train_step_keeps_pruned_weights_at_zero(setup):
  config, model, tx, state, batch = setup
  shapes = mst.kernel_shapes(state.params, state.sparsity)
  targets = {state_lib.layer_name(p): n for p, n in mst.target_counts(shapes, 0.75).items()}
  state, _ = _run(state, batch, model, targets, 0.3, 0.75)
  # Two steps: the learning rate of the first (warm-up from 0) is 0.
  new, _ = train.train_step(_copy(state), batch, model=model, tx=tx)
  new, metrics = train.train_step(new, batch, model=model, tx=tx)
  assert not any(k.startswith("flip_rate") for k in metrics)
  for p in state_lib.sparse_layer_paths(state.sparsity):
    m = np.asarray(state_lib.get_path(state.sparsity, p)["mask"])
    np.testing.assert_array_equal(np.asarray(state_lib.get_path(new.sparsity, p)["mask"]), m)
    w_old = np.asarray(state_lib.get_path(state.params, p)["kernel"])
    w_new = np.asarray(state_lib.get_path(new.params, p)["kernel"])
    assert (w_new[~m] == 0).all()
    assert (w_new[m] != w_old[m]).mean() > 0.9         # the active ones learn
    adam = new.opt_state[1]
    assert (np.asarray(state_lib.get_path(adam.mu, p)["kernel"])[~m] == 0).all()
  del config


def test_resumed_state_makes_the_same_update(setup, tmp_path):
  """Orbax round trip of a state with masks, then the same next update (same step rng)."""
  config, model, tx, state, batch = setup
  shapes = mst.kernel_shapes(state.params, state.sparsity)
  targets = {state_lib.layer_name(p): n for p, n in mst.target_counts(shapes, 0.7).items()}
  state, _ = _run(state, batch, model, targets, 0.3, 0.75)
  state, _ = train.train_step(_copy(state), batch, model=model, tx=tx)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(int(state.step), state, force=True)
  ckpt.close()
  fresh = jax.tree.map(jnp.zeros_like, state)      # the structure only; other values
  restored = ckpt_lib.Checkpointer(str(tmp_path)).restore_or_init(fresh)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               restored, state)
  targets = {state_lib.layer_name(p): n for p, n in mst.target_counts(shapes, 0.8).items()}
  a, ma = _run(state, batch, model, targets, 0.25, 0.5)
  b, mb = _run(restored, batch, model, targets, 0.25, 0.5)
  assert int(ma["mst/grown_random"]) > 0
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
  # A different step (rng) changes the random part of the growth.
  c, _ = _run(state.replace(step=state.step + 1), batch, model, targets, 0.25, 0.5)
  assert any(bool((state_lib.get_path(a.sparsity, p)["mask"]
                   != state_lib.get_path(c.sparsity, p)["mask"]).any())
             for p in state_lib.sparse_layer_paths(state.sparsity))
  del tx
