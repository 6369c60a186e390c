"""Tests for s24jax/methods/mst.py (Mixed Sparsity Training as the authors' code does it).

Each rule of the reference (tests/mst_reference.py states them) is pinned against a case
computed by hand, and two integration tests feed our update and the independent NumPy model
of the reference (tests/mst_reference.py) the same weights, gradients and random draws and
compare masks and weights after every update: on small synthetic layers, and on the tiny
GPT-2's layers (tied head included) trained by the real train step.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mst_reference as ref
from tiny import tiny_config

from s24jax import checkpoint as ckpt_lib
from s24jax import flops
from s24jax import losses
from s24jax import methods
from s24jax import model as model_lib
from s24jax import optim
from s24jax import state as state_lib
from s24jax import train
from s24jax.methods import base
from s24jax.methods import mst
from s24jax.state import TrainState

base_weight = base.kernel_at
flax_unfreeze = flax.core.unfreeze


def _method(total_steps=1000, **fields) -> mst.MST:
  c = tiny_config("mst", steps=total_steps)
  c.sparsity.sparse_layers = ("*/attn/*", "*/mlp/*", "wte")
  for k, v in fields.items():
    c.sparsity.mst[k] = v
  return methods.from_config(c)


# ---------------------------------------------------------------------------------------------
# Counts, hand-computed (the reference's own numbers on one 25 x 82 layer).

ONE = {"fc": (25, 82)}   # N = 2050; single-layer ER floats are exactly the global target


def _two_level(**fields):
  """T = 1000, Delta = 100, zeta = 0.3: 0.5 during [0, 200), 0.6 from 200 on."""
  return _method(1000, target_sparsity=0.5, ultra_sparsity=0.6, final_sparsity=0.6,
                 phase_fractions=(0.2, 0.8, 0.0), **fields)


def test_counts_forced_pruning_inside_the_drop_fraction():
  m = _two_level()
  assert mst.initial_counts(m, ONE, 1000) == {"fc": 1025}
  # Step 100, target 0.5 = the start: zeta_t = 0.15 (1 + cos(0.1 pi)) = 0.29266,
  # int(1025 * 0.29266) = 299 pruned and 299 grown (int(0.75 * 299) = 224 by gradient).
  c, s = mst.plan_update(m, ONE, {"fc": 1025}, 100, 1000)
  assert (c["fc"].n_prune, c["fc"].n_grad, c["fc"].n_rand, c["fc"].n_after) == (299, 224, 75,
                                                                               1025)
  assert s["mst/drop_fraction"] == pytest.approx(0.15 * (1 + math.cos(0.1 * math.pi)))
  # Step 200, 0.5 -> 0.6: delta = int((0.6 - 0.5) * 2050) = int(204.99999999999994) = 204;
  # zeta_t = 0.27135, int(1025 * 0.27135) = 278 >= delta: prune 278, grow 278 - 204 = 74
  # (int(74 * 0.75) = 55 by gradient, 19 at random); 821 left, not 820.
  c, s = mst.plan_update(m, ONE, {"fc": 1025}, 200, 1000)
  assert (c["fc"].n_prune, c["fc"].n_grad, c["fc"].n_rand, c["fc"].n_after) == (278, 55, 19, 821)
  assert s["mst/target_sparsity"] == 0.6 and s["mst/sparsity"] == 1 - 821 / 2050
  # Step 300: the measured 0.59951 is 4.9e-4 from 0.6 (> 1e-4), so the targets are recomputed:
  # delta = int((0.6 - 0.5995121951219512) * 2050) = int(1.0000000000000009) = 1;
  # int(821 * 0.23817) = 195: prune 195, grow 194, 820 left.
  c, _ = mst.plan_update(m, ONE, {"fc": 821}, 300, 1000)
  assert (c["fc"].n_prune, c["fc"].n_grad + c["fc"].n_rand, c["fc"].n_after) == (195, 194, 820)
  # Step 400 at 820 (measured exactly 0.6): same target, delta 0, a pure swap.
  c, _ = mst.plan_update(m, ONE, {"fc": 820}, 400, 1000)
  assert c["fc"].n_prune == c["fc"].n_grad + c["fc"].n_rand == int(820 * mst.drop_fraction(
      m, 400, 1000))


def test_counts_options_on_top_and_round_give_our_old_numbers():
  """The previous s24jax rule (forced pruning on top, round()ed targets) at step 200 prunes
  278 + 205 = 483 and grows 278."""
  m = _two_level(forced_prune="on_top", count_rounding="round")
  c, _ = mst.plan_update(m, ONE, {"fc": 1025}, 200, 1000)
  assert (c["fc"].n_prune, c["fc"].n_grad + c["fc"].n_rand, c["fc"].n_after) == (483, 278, 820)


def test_counts_small_cases():
  m = _method()
  # Sparsifying with a small swap: delta = int((0.7 - 0.4) * 10) = int(2.999999999999999) = 2,
  # int(6 * 0.1) = 0 -> prune 2 (forced), grow 0.
  c = mst.layer_counts(m, 10, 6, 0.1, 0.4, 0.7)
  assert (c.n_prune, c.n_grad, c.n_rand, c.n_after) == (2, 0, 0, 4)
  # Densifying: delta = int(-0.2 * 10) = -2, int(6 * 0.5) = 3 -> prune 3, grow 5 (3 + 2).
  c = mst.layer_counts(m, 10, 6, 0.5, 0.4, 0.2)
  assert (c.n_prune, c.n_grad, c.n_rand, c.n_after) == (3, 3, 2, 8)
  # regrow_dropped=False: growth only among the 4 inactive entries, the change kept.
  c = mst.layer_counts(_method(regrow_dropped=False), 10, 6, 0.9, 0.4, 0.4)
  assert (c.n_prune, c.n_grad + c.n_rand, c.n_after) == (4, 4, 6)


def test_grow_split_truncates():
  assert mst.grow_split(2, 3.0) == (1, 1)       # int(1.5); rounding would give (2, 0)
  assert mst.grow_split(74, 3.0) == (55, 19)    # int(55.5)
  assert mst.grow_split(10, math.inf) == (10, 0)
  assert mst.grow_split(10, 0.0) == (0, 10)
  for n in range(200):
    assert mst.grow_split(n, 3.0) == ref.grow_split(n, 3.0)


# ---------------------------------------------------------------------------------------------
# Layer sparsities.


def test_erdos_renyi_hand_cases_and_reference_floats():
  two = {"a": (4, 4), "b": (8, 4)}   # raw 0.5 and 0.375; at 0.5: eps = 24 / 20 = 1.2
  s = mst.erdos_renyi_sparsities(two, 0.5)
  assert s["a"] == pytest.approx(0.4) and s["b"] == pytest.approx(0.55)
  s = mst.erdos_renyi_sparsities(two, 0.1)   # a would need density 1.08: dense
  assert s["a"] == 0.0 and s["b"] == pytest.approx(0.15)
  # GPT-2 124M with the tied head, at 0.9 (the reference's set and order): identical floats;
  # densities c_attn 0.108, attn c_proj 0.162, c_fc / mlp c_proj 0.101, head 0.082.
  shapes = {}
  for i in range(12):
    shapes.update({f"h_{i}/attn/qkv": (2304, 768), f"h_{i}/attn/out": (768, 768),
                   f"h_{i}/mlp/fc": (3072, 768), f"h_{i}/mlp/proj": (768, 3072)})
  shapes["wte"] = (50304, 768)
  ours = mst.erdos_renyi_sparsities({k: shapes[k] for k in mst.reference_order(shapes)}, 0.9)
  theirs = ref.er_sparsities(ref.gpt2_layer_shapes(12, 768, 50304), 0.9)
  assert list(ours.values()) == list(theirs.values())       # bit for bit, in the same order
  dens = {k: 1 - v for k, v in ours.items()}
  assert [round(dens[k], 3) for k in ("h_0/attn/qkv", "h_0/attn/out", "h_0/mlp/fc", "wte")] == [
      0.108, 0.162, 0.101, 0.082]


def _er_bisection(shapes, density):
  """Independent: eps solving sum min(1, eps raw_l) size_l = density * total, by bisection."""
  raw = {k: (o + i) / (o * i) for k, (o, i) in shapes.items()}
  size = {k: o * i for k, (o, i) in shapes.items()}
  goal = density * sum(size.values())
  lo, hi = 0.0, 1e9
  for _ in range(200):
    mid = (lo + hi) / 2
    have = sum(min(1.0, mid * raw[k]) * size[k] for k in shapes)
    lo, hi = (mid, hi) if have < goal else (lo, mid)
  return {k: min(1.0, lo * raw[k]) for k in shapes}


@pytest.mark.parametrize("sparsity", [0.05, 0.4, 0.7, 0.9, 0.98])
def test_erdos_renyi_matches_bisection(sparsity):
  C = 64
  shapes = {"qkv": (3 * C, C), "out": (C, C), "fc": (4 * C, C), "proj": (C, 4 * C),
            "small": (8, 12)}
  got = mst.erdos_renyi_sparsities(shapes, sparsity)
  want = _er_bisection(shapes, 1 - sparsity)
  for k in shapes:
    assert 1 - got[k] == pytest.approx(want[k], abs=1e-9), k


def test_reference_layer_order_and_uniform():
  names = ["wte", "h_10/mlp/fc", "h_2/attn/out", "h_2/mlp/proj", "h_2/attn/qkv", "h_2/mlp/fc"]
  assert mst.reference_order(names) == ["h_2/attn/qkv", "h_2/attn/out", "h_2/mlp/fc",
                                        "h_2/mlp/proj", "h_10/mlp/fc", "wte"]
  assert mst.layer_sparsities({"a": (4, 8)}, 0.25, "uniform") == {"a": 0.25}
  with pytest.raises(ValueError, match="valid: erdos_renyi, uniform"):
    mst.layer_sparsities({"a": (4, 8)}, 0.25, "er")


# ---------------------------------------------------------------------------------------------
# Schedules and timing.


def test_updates_at_delta_multiples_never_at_step_0_nor_the_end():
  m = _method(1000)
  assert [t for t in range(1001) if m.update_due(t, 1000)] == list(range(100, 1000, 100))
  assert [t for t in range(1001) if m.update_due(t, 1000)] == ref.update_iterations(100, 1000)


def test_schedule_steps_is_piecewise_constant_and_applies_at_the_next_update():
  m = _method(1000, target_sparsity=0.8, ultra_sparsity=0.9, final_sparsity=0.5,
              phase_fractions=(0.25, 0.5, 0.25))
  s = lambda t: mst.target_sparsity(m, t, 1000)   # pylint: disable=unnecessary-lambda-assignment
  assert [s(t) for t in (0, 249, 250, 749, 750, 999)] == [0.8, 0.8, 0.9, 0.9, 0.5, 0.5]
  # The level of step 250 is first used by the update of step 300.
  updates = [t for t in range(1000) if m.update_due(t, 1000)]
  assert [s(t) for t in updates] == [0.8, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9, 0.5, 0.5]
  for t in updates:   # the reference's dict {0: .8, 250: .9, 750: .5} in iterations
    assert s(t) == ref.target_sparsity_at(t, {0: 0.8, 250: 0.9, 750: 0.5}, eval_interval=1)


def test_schedule_cosine_ramps_option():
  m = _method(1000, schedule="cosine_ramps", initial_sparsity=0.0, target_sparsity=0.8,
              ultra_sparsity=0.9, final_sparsity=0.5, phase_fractions=(0.2, 0.5, 0.3))
  s = lambda t: mst.target_sparsity(m, t, 1000)   # pylint: disable=unnecessary-lambda-assignment
  assert s(0) == 0.0 and s(50) == pytest.approx(0.4) and s(100) == pytest.approx(0.8)
  assert s(325) == pytest.approx(0.85) and s(450) == pytest.approx(0.9)
  assert s(850) == pytest.approx(0.5)


def test_drop_fraction_cosine():
  m = _method(1000, drop_fraction=0.3)
  for t in (0, 100, 250, 500, 900):
    assert mst.drop_fraction(m, t, 1000) == pytest.approx(ref.drop_fraction(t, 0.3, 1000),
                                                          rel=1e-15)
  assert mst.drop_fraction(m, 500, 1000) == pytest.approx(0.15)
  m = _method(1000, drop_fraction=0.3, anneal_per_phase=True, phase_fractions=(0.2, 0.5, 0.3))
  assert mst.drop_fraction(m, 200, 1000) == pytest.approx(0.3)     # restarts per phase
  assert mst.drop_fraction(m, 450, 1000) == pytest.approx(0.15)
  # The reference's stepwise annealing with keys at the phase starts: same value.
  zeta, start, end, coeff = ref.annealing_at(
      450, zeta=0.3, max_iters=1000, sparsity_schedule={0: 0.8, 200: 0.9, 700: 0.7},
      annealing_schedule={0: 0.3, 200: 0.3, 700: 0.3}, eval_interval=1, stepwise=True)
  assert mst.drop_fraction(m, 450, 1000) == pytest.approx(
      ref.drop_fraction(450, zeta, 1000, start=start, end=end, coeff=coeff), rel=1e-15)


def test_attention_window():
  m = _method(1000, sparse_attention="strided", sparse_attention_start=0.25,
              sparse_attention_end=0.5)
  assert mst.attention_window(m, 1000) == (250, 500)
  assert [mst.attention_at(m, t, 1000, "causal") for t in (0, 249, 250, 499, 500)] == [
      "causal", "causal", "strided", "strided", "causal"]


@pytest.mark.parametrize("field,value,match", [
    ("distribution", "random", "valid: erdos_renyi, uniform"),
    ("schedule", "ramps", "valid: steps, cosine_ramps"),
    ("init", "zeros", "valid: random, magnitude, dense"),
    ("forced_prune", "after", "valid: inside, on_top"),
    ("count_rounding", "floor", "valid: reference, round"),
    ("phase_fractions", (0.5, 0.6, 0.1), "summing to 1"),
    ("sparse_attention", "sliding", "valid: causal, strided, local_strided"),
    ("update_every", 0, "update_every must be an integer >= 1"),
    ("ultra_sparsity", 1.0, "ultra_sparsity must be in"),
])
def test_bad_config(field, value, match):
  with pytest.raises(ValueError, match=match):
    _method(**{field: value})


def test_unstructured_masks_need_the_xla_backend():
  c = tiny_config("mst", sparsity__backend="pallas")
  with pytest.raises(ValueError, match="needs sparsity.backend='xla'"):
    methods.from_config(c)


def test_schedule_plot(tmp_path):
  c = tiny_config("mst", steps=1000)
  c.sparsity.mst.sparse_attention = "local_strided"
  path = mst.plot_schedule(methods.from_config(c), c, str(tmp_path / "s.png"),
                           measured={"step": [100, 500], "sparsity": [0.8, 0.9]})
  assert (tmp_path / "s.png").stat().st_size > 1000 and path.endswith("s.png")


# ---------------------------------------------------------------------------------------------
# The update on a synthetic state: one hand-made layer, then several layers against the
# reference step for step.


def _synthetic(weights: dict, masks: dict, m: mst.MST, seed=0):
  """A TrainState of bare layers {name: {'kernel'}}, their masks, Adam + lr schedule state."""
  params = {k: {"kernel": jnp.asarray(w, jnp.float32)} for k, w in weights.items()}
  sparsity = {k: {"mask": jnp.asarray(v)} for k, v in masks.items()}
  sparsity[m.name] = {"due": jnp.zeros((), bool),
                      "counts": jnp.zeros((len(masks), 3), jnp.int32)}
  tx = optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(lambda c: 1e-2))
  return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params),
                    sparsity=sparsity, rng=jax.random.PRNGKey(seed)), tx


def _optimizer_step(state: TrainState, grads, tx, m: mst.MST) -> TrainState:
  """What train_step does before finish_step (MST: masked gradients, masked weights)."""
  g = m.gradients(grads, state.sparsity)
  updates, opt_state = tx.update(g, state.opt_state, state.params)
  params, sparsity, _ = m.after_update(optax.apply_updates(state.params, updates),
                                       state.sparsity, state.step)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                       sparsity=sparsity)


def _set_counts(state: TrainState, m: mst.MST, counts: dict[str, mst.LayerCounts]):
  paths = state_lib.sparse_layer_paths(state.sparsity)
  table = np.asarray([[counts[p[0]].n_prune, counts[p[0]].n_grad, counts[p[0]].n_rand]
                      for p in paths], np.int32)
  return state.replace(sparsity={**state.sparsity, m.name: {"due": jnp.asarray(True),
                                                            "counts": jnp.asarray(table)}})


@functools.partial(jax.jit, static_argnums=0)
def _finish(m, state, new_state, grads):
  return m.finish_step(state, new_state, grads, {})


# The hand-made 2 x 5 layer: 6 active weights (flat 1, 2, 4, 5, 7, 8), no ties.
W = np.array([[0.0, 0.9, -0.1, 0.0, 0.5], [0.3, 0.0, -0.7, 0.2, 0.0]], np.float32)
G = np.array([[0.05, 0.0, 0.8, 0.01, 0.0], [0.0, 0.6, 0.0, 0.0, 0.02]], np.float32)
HAND = mst.LayerCounts(n_prune=3, n_grad=2, n_rand=1, n_before=6, n_after=6)


def _u_first(flat: int, size: int = 10) -> np.ndarray:
  """Random keys that rank `flat` first (then the index order)."""
  u = np.arange(1, size + 1, dtype=np.uint32) * 1000
  u[flat] = 1
  return u


def test_update_layer_hand_case_regrows_dropped():
  """zeta_t = 0.5: prune int(6 * 0.5) = 3, the smallest |w|: flat 2, 8, 5 (0.1, 0.2, 0.3).
  Grow 3 (r = 3: int(2.25) = 2 by gradient): among all entries not kept, the largest |g| are
  flat 2 (0.8, just dropped) and 6 (0.6, new); then 1 at random among the rest
  [0, 3, 5, 8, 9]: the keys pick flat 8 (just dropped)."""
  m = W != 0
  assert mst.layer_counts(_method(), 10, 6, 0.5, 0.4, 0.4) == HAND
  new, info = mst.update_layer_mask(jnp.asarray(W), jnp.asarray(m), jnp.asarray(G), 3, 2, 1,
                                    jnp.asarray(_u_first(8)))
  flat = lambda x: sorted(np.flatnonzero(np.asarray(x)).tolist())   # pylint: disable=unnecessary-lambda-assignment
  assert flat(info["dropped"]) == [2, 5, 8]
  assert flat(info["grown_gradient"]) == [2, 6]
  assert flat(info["grown_random"]) == [8]
  assert flat(info["regrown_dropped"]) == [2, 8]
  assert flat(new) == [1, 2, 4, 6, 7, 8]
  # regrow_dropped=False: candidates are the 4 entries inactive before ([0, 3, 6, 9]); by
  # gradient flat 6 (0.6) and 0 (0.05); at random among [3, 9] the keys pick 9.
  new, info = mst.update_layer_mask(jnp.asarray(W), jnp.asarray(m), jnp.asarray(G), 3, 2, 1,
                                    jnp.asarray(_u_first(9)), regrow_dropped=False)
  assert flat(info["grown_gradient"]) == [0, 6] and flat(info["grown_random"]) == [9]
  assert flat(new) == [0, 1, 4, 6, 7, 9]


def test_random_growth_is_uniform_over_the_candidates():
  """Over many keys every candidate is grown at random about equally often (no pruning here,
  so the candidates are the 24 inactive entries)."""
  mask = np.zeros(48, bool)
  mask[::2] = True
  mask = mask.reshape(6, 8)
  w = jnp.where(mask, 1.0, 0.0)
  keys = jax.random.split(jax.random.PRNGKey(0), 4000)
  f = jax.jit(jax.vmap(lambda k: mst.update_layer_mask(
      w, mask, jnp.zeros((6, 8)), 0, 0, 6, mst.random_keys(k, 48))[1]["grown_random"]))
  counts = np.asarray(f(keys)).sum(0).reshape(-1)                  # 6 grown per key
  assert counts[mask.reshape(-1)].sum() == 0
  p = 6 / 24
  expect, sd = 4000 * p, math.sqrt(4000 * p * (1 - p))
  assert np.all(np.abs(counts[~mask.reshape(-1)] - expect) < 5 * sd)


def test_update_step_values_moments_and_the_skipped_optimizer_step():
  """The hand case through finish_step: kept and regrown-dropped weights keep their value,
  the new one starts at 0; the optimizer step is undone (Adam moments and count as before
  the step, only the lr schedule count advances); the masks' flag is cleared."""
  m = _method()
  state, tx = _synthetic({"L": W}, {"L": W != 0}, m)
  # A first ordinary step gives non-zero moments.
  grads = {"L": {"kernel": jnp.asarray(G)}}
  state = _optimizer_step(state, grads, tx, m)
  state = state.replace(params={"L": {"kernel": jnp.asarray(W)}})   # back to the hand weights
  due = _set_counts(state, m, {"L": HAND})
  u = np.asarray(mst.random_keys(jax.random.fold_in(mst.update_rng(due), 0), 10))
  new_state = _optimizer_step(due, grads, tx, m)
  out, metrics = _finish(m, due, new_state, grads)
  # The same update in the reference, fed the same random keys.
  nm, nw, info = ref.reference_update_detailed({"L": W}, {"L": W != 0}, {"L": G}, {"L": 0.4},
                                               {"L": 0.4}, 0.5, 3,
                                               random_perms=ref.perm_from_keys(u))
  mask = np.asarray(out.sparsity["L"]["mask"])
  np.testing.assert_array_equal(mask, nm["L"])
  np.testing.assert_array_equal(np.asarray(out.params["L"]["kernel"]), nw["L"])
  assert np.asarray(out.params["L"]["kernel"]).reshape(-1)[6] == 0.0      # new: starts at 0
  assert np.asarray(out.params["L"]["kernel"]).reshape(-1)[2] == np.float32(-0.1)  # regrown
  assert int(metrics["mst/dropped"]) == 3 and int(metrics["mst/regrown_dropped"]) == int(
      info["L"]["regrown_dropped"].sum())
  adam, sched = out.opt_state
  np.testing.assert_array_equal(np.asarray(adam.mu["L"]["kernel"]),
                                np.asarray(due.opt_state[0].mu["L"]["kernel"]))
  np.testing.assert_array_equal(np.asarray(adam.nu["L"]["kernel"]),
                                np.asarray(due.opt_state[0].nu["L"]["kernel"]))
  assert int(adam.count) == int(due.opt_state[0].count) == 1        # Adam did not step
  assert int(sched.count) == 2 and int(out.step) == 2               # the lr schedule did
  assert not bool(out.sparsity[m.name]["due"])
  # Option reset_moments: zero moments exactly where the mask changed.
  r = dataclasses.replace(m, reset_moments=True)
  out_r, _ = _finish(r, due, new_state, grads)
  changed = mask != (W != 0)
  mu = np.asarray(out_r.opt_state[0].mu["L"]["kernel"])
  assert (mu[changed] == 0).all()
  np.testing.assert_array_equal(mu[~changed], np.asarray(due.opt_state[0].mu["L"]["kernel"])[
      ~changed])
  # Option train_on_update_step: the optimizer step is kept (Adam count 2), the update then
  # applies to the stepped weights.
  t = dataclasses.replace(m, train_on_update_step=True)
  out_t, _ = _finish(t, due, new_state, grads)
  assert int(out_t.opt_state[0].count) == 2
  np.testing.assert_array_equal(np.asarray(out_t.sparsity["L"]["mask"]), nm["L"])
  # A step without the flag is the optimizer step, untouched.
  plain, metrics = _finish(m, state, _optimizer_step(state, grads, tx, m), grads)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               plain, _optimizer_step(state, grads, tx, m))
  assert np.isnan(float(metrics["mst/dropped"]))


def test_synthetic_layers_match_the_reference_step_for_step():
  """Three layers (ER with unequal shapes), 9 updates at T = 1000: 0.5, then 0.7 from step 200,
  then 0.4 from 700 (sparsify, swap, densify). Between updates the weights move (a random walk
  on the active entries); at each update both implementations get the same weights, masks,
  dense gradients and random keys, and must agree on masks and weights."""
  m = _method(1000, target_sparsity=0.5, ultra_sparsity=0.7, final_sparsity=0.4,
              phase_fractions=(0.2, 0.5, 0.3))
  shapes = {"a": (25, 82), "b": (16, 40), "c": (48, 12)}
  names = mst.reference_order(shapes)
  rng = np.random.default_rng(0)
  sch = ref.ReferenceScheduler({k: shapes[k] for k in names}, 0.5, t_end=1000, delta=100,
                               zeta=0.3, grow_ratio=3)
  init_u = {k: rng.permutation(int(np.prod(s))) for k, s in shapes.items()}
  masks = sch.initial_masks(init_u)
  w = {k: (rng.standard_normal(s) * masks[k]).astype(np.float32) for k, s in shapes.items()}
  state, tx = _synthetic(w, masks, m)
  n_active = {k: int(v.sum()) for k, v in masks.items()}
  assert n_active == mst.initial_counts(m, {k: shapes[k] for k in names}, 1000)
  n_regrown = 0
  for it in range(100, 1000, 100):
    # The weights before the update (pruned ones exactly 0), the step's dense gradient.
    mask_now = {k: np.asarray(state.sparsity[k]["mask"]) for k in shapes}
    w = {k: (rng.standard_normal(s) * mask_now[k]).astype(np.float32)
         for k, s in shapes.items()}
    g = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    state = state.replace(step=jnp.asarray(it, jnp.int32),
                          params={k: {"kernel": jnp.asarray(v)} for k, v in w.items()})
    counts, _ = mst.plan_update(m, {k: shapes[k] for k in names},
                                {k: int(v.sum()) for k, v in mask_now.items()}, it, 1000)
    due = _set_counts(state, m, counts)
    grads = {k: {"kernel": jnp.asarray(v)} for k, v in g.items()}
    out, _ = _finish(m, due, _optimizer_step(due, grads, tx, m), grads)
    paths = state_lib.sparse_layer_paths(due.sparsity)
    keys = {p[0]: np.asarray(mst.random_keys(jax.random.fold_in(mst.update_rng(due), i),
                                             int(np.prod(shapes[p[0]]))))
            for i, p in enumerate(paths)}
    target = mst.target_sparsity(m, it, 1000)
    ref_masks, ref_w, info = sch.update(it, target, w, mask_now, g,
                                        random_perms=ref.perm_from_keys(keys))
    for k in shapes:
      np.testing.assert_array_equal(np.asarray(out.sparsity[k]["mask"]), ref_masks[k], k)
      np.testing.assert_array_equal(np.asarray(out.params[k]["kernel"]), ref_w[k], k)
      assert counts[k].n_prune == info[k]["n_prune"] and counts[k].n_grad == info[k]["n_grad"]
      n_regrown += int(info[k]["regrown_dropped"].sum())
    state = out
  assert n_regrown > 0    # the run exercised regrowth of just-dropped entries
  assert sch.sparsity == pytest.approx(1 - sum(int(np.asarray(state.sparsity[k]["mask"]).sum())
                                               for k in shapes) / sum(
                                                   int(np.prod(s)) for s in shapes.values()))


# ---------------------------------------------------------------------------------------------
# The tiny GPT-2 (all block linears and the tied head sparse), trained by the real train step.


class _Recording(mst.MST):
  """MST that also returns the step's raw gradients and pre-step params as metrics."""

  def finish_step(self, state, new_state, grads, metrics):
    new_state, metrics = super().finish_step(state, new_state, grads, metrics)
    return new_state, {**metrics, "raw_grads": grads, "before": state.params}


def _tiny(steps=16, **fields):
  """(config, method, model, tx, fresh state) of a 1-layer, 32-wide GPT-2 with a 256-token
  vocabulary (the batches are synthetic), every linear layer and the tied head sparse."""
  c, method, model, tx, state = _tiny_cached(steps, tuple(sorted(fields.items())))
  return c, method, model, tx, jax.tree.map(jnp.copy, state)


@functools.lru_cache(maxsize=None)
def _tiny_cached(steps, fields):
  c = tiny_config("mst", steps=steps)
  c.model.vocab_size = 256
  c.sparsity.sparse_layers = ("*/attn/*", "*/mlp/*", "wte")
  c.sparsity.mst.update_every = 3
  c.sparsity.mst.target_sparsity = 0.5
  c.sparsity.mst.ultra_sparsity = 0.7
  c.sparsity.mst.final_sparsity = 0.4
  for k, v in fields:
    c.sparsity.mst[k] = v
  plain = methods.from_config(c)
  method = _Recording(**{f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)})
  model_cfg = model_lib.model_config(c, method)
  model = model_lib.GPT2(model_cfg)

  def tx_fn(params, sparsity):
    return optim.make_optimizer(c, state_lib.is_sparse_kernel(params, sparsity), method)

  state = jax.jit(lambda: train.init_state(model, tx_fn, c.seed))()
  return c, method, model, tx_fn(state.params, state.sparsity), state


class _Run:
  """The loop's view for the method's before-step hook."""

  def __init__(self, state, model_cfg):
    self.state, self.model_cfg, self.step, self.scalars = state, model_cfg, 0, []

  def write(self, step, scalars):
    self.scalars.append((step, scalars))


def test_init_random_mask_matches_the_reference():
  c, method, model, _, state = _tiny()
  shapes = mst.layer_shapes(state.params, state.sparsity)
  assert list(shapes) == ["h_0/attn/qkv", "h_0/attn/out", "h_0/mlp/fc", "h_0/mlp/proj", "wte"]
  assert shapes["wte"] == (c.model.vocab_size, c.model.d_model)
  # init_train on the same fresh params with a chosen key, against the reference's draw.
  variables = model.init(jax.random.PRNGKey(1), jnp.zeros((1, c.model.seq_len), jnp.int32))
  params, sparsity = method.init_train(flax_unfreeze(variables["params"]),
                                       flax_unfreeze(variables["sparsity"]),
                                       jax.random.PRNGKey(7))
  s0 = mst.layer_sparsities(shapes, 0.5)
  perms = {}
  for j, p in enumerate(state_lib.sparse_layer_paths(sparsity)):
    u = np.asarray(mst.random_keys(jax.random.fold_in(jax.random.PRNGKey(7), j),
                                   int(np.prod(shapes[state_lib.layer_name(p)]))))
    perms[state_lib.layer_name(p)] = np.argsort(u, kind="stable")
  want = ref.initial_masks(shapes, s0, perms)
  for p in state_lib.sparse_layer_paths(sparsity):
    name = state_lib.layer_name(p)
    mask = np.asarray(state_lib.get_path(sparsity, p)["mask"])
    np.testing.assert_array_equal(mask, want[name], name)
    w = np.asarray(base_weight(params, p))
    assert (w[~mask] == 0).all() and (w[mask] != 0).all()
    n = mask.size
    assert mask.sum() == n - int(s0[name] * n)
  # The head is the sparsest layer (ER), and the model's lookup and head use one table.
  assert s0["wte"] == max(s0.values())
  # init='dense' keeps every weight.
  _, sp = dataclasses.replace(method, init="dense").init_train(
      flax_unfreeze(variables["params"]), flax_unfreeze(variables["sparsity"]),
      jax.random.PRNGKey(7))
  assert all(bool(state_lib.get_path(sp, p)["mask"].all())
             for p in state_lib.sparse_layer_paths(sp))


def test_tiny_model_matches_the_reference_step_for_step():
  """16 steps, updates at 3, 6, 9, 12, 15 (targets 0.5, 0.7, 0.7, 0.4, 0.4): the real train
  step, the method's hook, and at every update the reference fed the same pre-update weights,
  masks, the step's raw gradients and random keys. Masks and sparse weights must agree; on
  update steps no parameter moves except through the mask; the FLOP plan's counts are the
  run's."""
  c, method, model, tx, state = _tiny()
  total = c.total_steps
  shapes = mst.layer_shapes(state.params, state.sparsity)
  paths = state_lib.sparse_layer_paths(state.sparsity)
  by_name = {state_lib.layer_name(p): p for p in paths}
  sch = ref.ReferenceScheduler(shapes, 0.5, t_end=total, delta=3, zeta=0.3, grow_ratio=3)
  run = _Run(state, model.config)
  hook = [h for h in method.hooks(c) if h.before_step][0]
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, c.model.vocab_size, (c.batch_size, c.model.seq_len + 1))
  batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
           "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
  first, history = mst._count_history(  # pylint: disable=protected-access
      method, tuple(shapes.items()), total)
  active = lambda st: {state_lib.layer_name(p): int(  # pylint: disable=unnecessary-lambda-assignment
      state_lib.get_path(st.sparsity, p)["mask"].sum()) for p in paths}
  assert active(run.state) == first
  n_updates, n_regrown = 0, 0
  for step in range(total):
    run.step = step
    if hook.is_due(step, total):
      hook.fn(run)
    before = run.state
    due = bool(before.sparsity[method.name]["due"])
    masks_before = {n: np.asarray(state_lib.get_path(before.sparsity, p)["mask"])
                    for n, p in by_name.items()}
    keys = {state_lib.layer_name(p): np.asarray(mst.random_keys(
        jax.random.fold_in(mst.update_rng(before), i), masks_before[state_lib.layer_name(p)].size))
            for i, p in enumerate(paths)} if due else None
    before_copy = jax.tree.map(np.asarray, before)
    run.state, metrics = train.train_step(before, batch, model=model, tx=tx)
    assert due == (step in (3, 6, 9, 12, 15))
    if not due:
      continue
    n_updates += 1
    w = {n: np.asarray(base_weight(metrics["before"], p)) for n, p in by_name.items()}
    g = {n: np.asarray(base_weight(metrics["raw_grads"], p)) for n, p in by_name.items()}
    ref_masks, ref_w, info = sch.update(step, mst.target_sparsity(method, step, total), w,
                                        masks_before, g, random_perms=ref.perm_from_keys(keys))
    for n, p in by_name.items():
      np.testing.assert_array_equal(np.asarray(state_lib.get_path(run.state.sparsity, p)["mask"]),
                                    ref_masks[n], n)
      np.testing.assert_array_equal(np.asarray(base_weight(run.state.params, p)), ref_w[n], n)
      n_regrown += int(info[n]["regrown_dropped"].sum())
    # The skipped step: dense parameters and Adam's state as before.
    np.testing.assert_array_equal(np.asarray(run.state.params["ln_f"]["scale"]),
                                  before_copy.params["ln_f"]["scale"])
    np.testing.assert_array_equal(np.asarray(run.state.params["wpe"]), before_copy.params["wpe"])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b),
                 run.state.opt_state[2], before_copy.opt_state[2])     # scale_by_adam
    assert active(run.state) == history[step]
  assert n_updates == 5 and n_regrown > 0
  assert sch.sparsity == pytest.approx(1 - sum(active(run.state).values()) / sum(
      int(np.prod(s)) for s in shapes.values()))
  # The host scalars the hook logged: the planned sparsity after each update.
  assert [s for s, _ in run.scalars] == [3, 6, 9, 12, 15]
  assert run.scalars[-1][1]["mst/sparsity"] == pytest.approx(sch.sparsity)
  # FLOPs: the planned run's counts are these; update steps compute the dense weight gradient.
  plan = flops.planned(c)
  assert plan.steps == total and plan.nnz == active(run.state)


def test_growth_gradient_is_the_dense_gradient_at_w_tilde():
  """The raw gradient finish_step sees is dL/dW~ of the step's mean loss, dense (pruned entries
  included), tied head and embedding summed: it equals the gradient of the dense model
  evaluated at W~ = mask * W."""
  c, method, model, tx, state = _tiny()
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, c.model.vocab_size, (c.batch_size, c.model.seq_len + 1))
  batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
           "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
  _, metrics = train.train_step(jax.tree.map(jnp.copy, state), batch, model=model, tx=tx)
  dense = model_lib.GPT2(model.config.dense_twin())
  w_tilde = state_lib.mask_sparse_kernels(state.params, state.sparsity)

  def loss(params):
    logits = dense.apply({"params": params}, batch["inputs"])
    return losses.cross_entropy_sum(logits, batch["targets"]) / batch["targets"].size

  want = jax.jit(jax.grad(loss))(w_tilde)
  for p in state_lib.sparse_layer_paths(state.sparsity):
    got = np.asarray(base_weight(metrics["raw_grads"], p))
    mask = np.asarray(state_lib.get_path(state.sparsity, p)["mask"])
    np.testing.assert_allclose(got, np.asarray(base_weight(want, p)), rtol=2e-4, atol=1e-7)
    assert (got[~mask] != 0).mean() > 0.5        # dense: the pruned entries have gradients


def test_resumed_state_makes_the_same_update(tmp_path):
  """Orbax round trip of a state whose update is due, then the same step (same draws)."""
  c, method, model, tx, state = _tiny()
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, c.model.vocab_size, (c.batch_size, c.model.seq_len + 1))
  batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
           "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
  run = _Run(state, model.config)
  hook = [h for h in method.hooks(c) if h.before_step][0]
  for step in range(3):
    run.state, _ = train.train_step(run.state, batch, model=model, tx=tx)
  run.step = 3
  hook.fn(run)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(3, run.state, force=True)
  ckpt.close()
  restored = ckpt_lib.Checkpointer(str(tmp_path)).restore_or_init(
      jax.tree.map(jnp.zeros_like, run.state))
  a, ma = train.train_step(jax.tree.map(jnp.copy, run.state), batch, model=model, tx=tx)
  b, mb = train.train_step(restored, batch, model=model, tx=tx)
  assert float(ma["mst/dropped"]) > 0
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
  del mb


def test_flop_profile_counts_the_sparse_head_and_dense_weight_gradients():
  c, method, _, _, _ = _tiny()
  model_cfg, shapes, masked = flops.model_shapes(c)
  assert set(masked) == set(shapes) | {"wte"} and masked["wte"] == (c.model.vocab_size,
                                                                   c.model.d_model)
  first, history = mst._count_history(  # pylint: disable=protected-access
      method, tuple((k, masked[k]) for k in mst.reference_order(masked)), c.total_steps)
  assert method.flop_profile(0, masked, c) == (first, False)
  assert method.flop_profile(3, masked, c) == (None, True)       # old masks, dense dW
  assert method.flop_profile(4, masked, c) == (history[3], False)
  B, T, V, C = c.batch_size, c.model.seq_len, c.model.vocab_size, c.model.d_model
  tokens = B * T
  step = flops.step_flops(model_cfg, shapes, first, batch_size=B, seq_len=T, attention="causal")
  assert step.head == 6 * first["wte"] * tokens
  upd = flops.step_flops(model_cfg, shapes, first, batch_size=B, seq_len=T, attention="causal",
                         dense_weight_gradient=True)
  size = sum(o * i for o, i in shapes.values())
  active = sum(first[k] for k in shapes)
  assert upd.linear == (4 * active + 2 * size) * tokens
  assert upd.head == (4 * first["wte"] + 2 * V * C) * tokens
  assert upd.update == upd.total - step.total
