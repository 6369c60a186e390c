"""Tests for s24jax/methods/mst/ (Mixed Sparsity Training as the authors' code does it).

Each rule of the reference (tests/methods/mst_reference.py states them) is pinned against a
case computed by hand, and two integration tests feed our update and the independent NumPy
model of the reference (tests/methods/mst_reference.py) the same weights, gradients and random
draws and compare masks and weights after every update: on small synthetic layers, and on
the tiny GPT-2's layers (tied head included) trained by the real train step, where the counts
the device update reads come from the plan made at init (`counts.plan`) and must be the
counts the masks really reach. `update_due`, the one timing rule, is checked on host ints and
traced steps alike.
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

from s24jax.training import checkpoint as ckpt_lib
from s24jax.training import flops
from s24jax.nn import losses
from s24jax.nn import model as model_lib
from s24jax.training import optim
from s24jax import state as state_lib
from s24jax.training import train
from s24jax.methods import base
from s24jax.methods import registry
from s24jax.methods.mst import counts as counts_lib
from s24jax.methods.mst import densities
from s24jax.methods.mst import plot
from s24jax.methods.mst import schedule
from s24jax.methods.mst import topology
from s24jax.methods.mst.method import MST
from s24jax.methods.mst.method import MSTState
from s24jax.training.run_spec import RunSpec
from s24jax.state import TrainState
from s24jax.step_info import StepInfo

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")

base_weight = base.kernel_at
flax_unfreeze = flax.core.unfreeze


def _method(total_steps=1000, **fields) -> MST:
  c = tiny_config("mst", steps=total_steps)
  c.sparsity.sparse_layers = ("*/attn/*", "*/mlp/*", "wte")
  for k, v in fields.items():
    c.sparsity.mst[k] = v
  return registry.from_config(c)


# ---------------------------------------------------------------------------------------------
# Counts, hand-computed (the reference's own numbers on one 25 x 82 layer).

ONE = {"fc": (25, 82)}   # N = 2050; single-layer ER floats are exactly the global target


def _two_level(**fields):
  """T = 1000, Delta = 100, zeta = 0.3: 0.5 during [0, 200), 0.6 from 200 on."""
  return _method(1000, target_sparsity=0.5, ultra_sparsity=0.6, final_sparsity=0.6,
                 phase_fractions=(0.2, 0.8, 0.0), **fields)


def test_counts_forced_pruning_inside_the_drop_fraction():
  m = _two_level()
  assert counts_lib.initial_counts(m, ONE, 1000) == {"fc": 1025}
  # Step 100, target 0.5 = the start: zeta_t = 0.15 (1 + cos(0.1 pi)) = 0.29266,
  # int(1025 * 0.29266) = 299 pruned and 299 grown (int(0.75 * 299) = 224 by gradient).
  c, s = counts_lib.plan_update(m, ONE, {"fc": 1025}, 100, 1000)
  assert (c["fc"].n_prune, c["fc"].n_grad, c["fc"].n_rand, c["fc"].n_after) == (299, 224, 75,
                                                                               1025)
  assert s["mst/drop_fraction"] == pytest.approx(0.15 * (1 + math.cos(0.1 * math.pi)))
  # Step 200, 0.5 -> 0.6: delta = int((0.6 - 0.5) * 2050) = int(204.99999999999994) = 204;
  # zeta_t = 0.27135, int(1025 * 0.27135) = 278 >= delta: prune 278, grow 278 - 204 = 74
  # (int(74 * 0.75) = 55 by gradient, 19 at random); 821 left, not 820.
  c, s = counts_lib.plan_update(m, ONE, {"fc": 1025}, 200, 1000)
  assert (c["fc"].n_prune, c["fc"].n_grad, c["fc"].n_rand, c["fc"].n_after) == (278, 55, 19, 821)
  assert s["mst/target_sparsity"] == 0.6 and s["mst/sparsity"] == 1 - 821 / 2050
  # Step 300: the measured 0.59951 is 4.9e-4 from 0.6 (> 1e-4), so the targets are recomputed:
  # delta = int((0.6 - 0.5995121951219512) * 2050) = int(1.0000000000000009) = 1;
  # int(821 * 0.23817) = 195: prune 195, grow 194, 820 left.
  c, _ = counts_lib.plan_update(m, ONE, {"fc": 821}, 300, 1000)
  assert (c["fc"].n_prune, c["fc"].n_grad + c["fc"].n_rand, c["fc"].n_after) == (195, 194, 820)
  # Step 400 at 820 (measured exactly 0.6): same target, delta 0, a pure swap.
  c, _ = counts_lib.plan_update(m, ONE, {"fc": 820}, 400, 1000)
  assert c["fc"].n_prune == c["fc"].n_grad + c["fc"].n_rand == int(820 * schedule.drop_fraction(
      m, 400, 1000))


def test_counts_options_on_top_and_round_give_our_old_numbers():
  """The previous s24jax rule (forced pruning on top, round()ed targets) at step 200 prunes
  278 + 205 = 483 and grows 278."""
  m = _two_level(forced_prune="on_top", count_rounding="round")
  c, _ = counts_lib.plan_update(m, ONE, {"fc": 1025}, 200, 1000)
  assert (c["fc"].n_prune, c["fc"].n_grad + c["fc"].n_rand, c["fc"].n_after) == (483, 278, 820)


def test_counts_small_cases():
  m = _method()
  # Sparsifying with a small swap: delta = int((0.7 - 0.4) * 10) = int(2.999999999999999) = 2,
  # int(6 * 0.1) = 0 -> prune 2 (forced), grow 0.
  c = counts_lib.layer_counts(m, 10, 6, 0.1, 0.4, 0.7)
  assert (c.n_prune, c.n_grad, c.n_rand, c.n_after) == (2, 0, 0, 4)
  # Densifying: delta = int(-0.2 * 10) = -2, int(6 * 0.5) = 3 -> prune 3, grow 5 (3 + 2).
  c = counts_lib.layer_counts(m, 10, 6, 0.5, 0.4, 0.2)
  assert (c.n_prune, c.n_grad, c.n_rand, c.n_after) == (3, 3, 2, 8)
  # regrow_dropped=False: growth only among the 4 inactive entries, the change kept.
  c = counts_lib.layer_counts(_method(regrow_dropped=False), 10, 6, 0.9, 0.4, 0.4)
  assert (c.n_prune, c.n_grad + c.n_rand, c.n_after) == (4, 4, 6)


def test_grow_split_truncates():
  assert counts_lib.grow_split(2, 3.0) == (1, 1)       # int(1.5); rounding would give (2, 0)
  assert counts_lib.grow_split(74, 3.0) == (55, 19)    # int(55.5)
  assert counts_lib.grow_split(10, math.inf) == (10, 0)
  assert counts_lib.grow_split(10, 0.0) == (0, 10)
  for n in range(200):
    assert counts_lib.grow_split(n, 3.0) == ref.grow_split(n, 3.0)


# ---------------------------------------------------------------------------------------------
# Layer sparsities.


def test_erdos_renyi_hand_cases_and_reference_floats():
  two = {"a": (4, 4), "b": (8, 4)}   # raw 0.5 and 0.375; at 0.5: eps = 24 / 20 = 1.2
  s = densities.erdos_renyi_sparsities(two, 0.5)
  assert s["a"] == pytest.approx(0.4) and s["b"] == pytest.approx(0.55)
  s = densities.erdos_renyi_sparsities(two, 0.1)   # a would need density 1.08: dense
  assert s["a"] == 0.0 and s["b"] == pytest.approx(0.15)
  # GPT-2 124M with the tied head, at 0.9 (the reference's set and order): identical floats;
  # densities c_attn 0.108, attn c_proj 0.162, c_fc / mlp c_proj 0.101, head 0.082.
  shapes = {}
  for i in range(12):
    shapes.update({f"h_{i}/attn/qkv": (2304, 768), f"h_{i}/attn/out": (768, 768),
                   f"h_{i}/mlp/fc": (3072, 768), f"h_{i}/mlp/proj": (768, 3072)})
  shapes["wte"] = (50304, 768)
  ours = densities.erdos_renyi_sparsities(
      {k: shapes[k] for k in densities.reference_order(shapes)}, 0.9)
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
  got = densities.erdos_renyi_sparsities(shapes, sparsity)
  want = _er_bisection(shapes, 1 - sparsity)
  for k in shapes:
    assert 1 - got[k] == pytest.approx(want[k], abs=1e-9), k


def test_reference_layer_order_and_uniform():
  names = ["wte", "h_10/mlp/fc", "h_2/attn/out", "h_2/mlp/proj", "h_2/attn/qkv", "h_2/mlp/fc"]
  assert densities.reference_order(names) == ["h_2/attn/qkv", "h_2/attn/out", "h_2/mlp/fc",
                                        "h_2/mlp/proj", "h_10/mlp/fc", "wte"]
  assert densities.layer_sparsities({"a": (4, 8)}, 0.25, "uniform") == {"a": 0.25}
  with pytest.raises(ValueError, match="valid: erdos_renyi, uniform"):
    densities.layer_sparsities({"a": (4, 8)}, 0.25, "er")


# ---------------------------------------------------------------------------------------------
# Schedules and timing.


def test_updates_at_delta_multiples_never_at_step_0_nor_the_end():
  m = _method(1000)
  assert [t for t in range(1001) if m.update_due(t, 1000)] == list(range(100, 1000, 100))
  assert [t for t in range(1001) if m.update_due(t, 1000)] == ref.update_iterations(100, 1000)


def test_schedule_steps_is_piecewise_constant_and_applies_at_the_next_update():
  m = _method(1000, target_sparsity=0.8, ultra_sparsity=0.9, final_sparsity=0.5,
              phase_fractions=(0.25, 0.5, 0.25))
  s = functools.partial(schedule.target_sparsity, m, total_steps=1000)
  assert [s(t) for t in (0, 249, 250, 749, 750, 999)] == [0.8, 0.8, 0.9, 0.9, 0.5, 0.5]
  # The level of step 250 is first used by the update of step 300.
  updates = [t for t in range(1000) if m.update_due(t, 1000)]
  assert [s(t) for t in updates] == [0.8, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9, 0.5, 0.5]
  for t in updates:   # the reference's dict {0: .8, 250: .9, 750: .5} in iterations
    assert s(t) == ref.target_sparsity_at(t, {0: 0.8, 250: 0.9, 750: 0.5}, eval_interval=1)


def test_schedule_cosine_ramps_option():
  m = _method(1000, schedule="cosine_ramps", initial_sparsity=0.0, target_sparsity=0.8,
              ultra_sparsity=0.9, final_sparsity=0.5, phase_fractions=(0.2, 0.5, 0.3))
  s = functools.partial(schedule.target_sparsity, m, total_steps=1000)
  assert s(0) == 0.0 and s(50) == pytest.approx(0.4) and s(100) == pytest.approx(0.8)
  assert s(325) == pytest.approx(0.85) and s(450) == pytest.approx(0.9)
  assert s(850) == pytest.approx(0.5)


def test_drop_fraction_cosine():
  m = _method(1000, drop_fraction=0.3)
  for t in (0, 100, 250, 500, 900):
    assert schedule.drop_fraction(m, t, 1000) == pytest.approx(ref.drop_fraction(t, 0.3, 1000),
                                                          rel=1e-15)
  assert schedule.drop_fraction(m, 500, 1000) == pytest.approx(0.15)
  m = _method(1000, drop_fraction=0.3, anneal_per_phase=True, phase_fractions=(0.2, 0.5, 0.3))
  assert schedule.drop_fraction(m, 200, 1000) == pytest.approx(0.3)     # restarts per phase
  assert schedule.drop_fraction(m, 450, 1000) == pytest.approx(0.15)
  # The reference's stepwise annealing with keys at the phase starts: same value.
  zeta, start, end, coeff = ref.annealing_at(
      450, zeta=0.3, max_iters=1000, sparsity_schedule={0: 0.8, 200: 0.9, 700: 0.7},
      annealing_schedule={0: 0.3, 200: 0.3, 700: 0.3}, eval_interval=1, stepwise=True)
  assert schedule.drop_fraction(m, 450, 1000) == pytest.approx(
      ref.drop_fraction(450, zeta, 1000, start=start, end=end, coeff=coeff), rel=1e-15)


def test_attention_window():
  m = _method(1000, sparse_attention="strided", sparse_attention_start=0.25,
              sparse_attention_end=0.5)
  assert schedule.attention_window(m, 1000) == (250, 500)
  assert [schedule.attention_at(m, t, 1000, "causal") for t in (0, 249, 250, 499, 500)] == [
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
  c = tiny_config("mst", overrides={"sparsity.backend": "pallas"})
  with pytest.raises(ValueError, match="needs sparsity.backend='xla'"):
    registry.from_config(c)


def test_schedule_plot(tmp_path):
  c = tiny_config("mst", steps=1000)
  c.sparsity.mst.sparse_attention = "local_strided"
  path = plot.plot_schedule(registry.from_config(c), c.total_steps, c.model.attention_stride,
                            str(tmp_path / "s.png"),
                            measured={"step": [100, 500], "sparsity": [0.8, 0.9]})
  assert (tmp_path / "s.png").stat().st_size > 1000 and path.endswith("s.png")


# ---------------------------------------------------------------------------------------------
# The update on a synthetic state: one hand-made layer, then several layers against the
# reference step for step.


def _synthetic(weights: dict, masks: dict, m: MST, seed=0):
  """A TrainState of bare layers {name: {'kernel'}}, their masks and an empty plan, with the
  optimizer the run builds around MST (s24jax/training/optim.py): its 'raw' gradient mask, then Adam
  and an lr schedule."""
  params = {k: {"kernel": jnp.asarray(w, jnp.float32)} for k, w in weights.items()}
  sparsity = {k: {"mask": jnp.asarray(v)} for k, v in masks.items()}
  tx = optax.with_extra_args_support(optax.chain(
      *m.optimizer_transforms("raw", state_lib.is_sparse_kernel(params, sparsity)),
      optax.scale_by_adam(), optax.scale_by_learning_rate(lambda c: 1e-2)))
  return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params),
                    sparsity=sparsity,
                    method_state=MSTState(counts=jnp.zeros((1, len(masks), 3), jnp.int32)),
                    rng=jax.random.PRNGKey(seed)), tx


def _with_plan(state: TrainState, m: MST,
               updates: dict[int, dict[str, counts_lib.LayerCounts]]) -> TrainState:
  """The state with a plan whose row t / Delta - 1 holds the counts of update step t (the
  layers in sparse_layer_paths order, as `Plan.table`), zeros elsewhere."""
  names = [state_lib.layer_name(p) for p in state_lib.sparse_layer_paths(state.sparsity)]
  table = np.zeros((max(updates) // m.update_every, len(names), 3), np.int32)
  for t, counts in updates.items():
    table[t // m.update_every - 1] = [[counts[k].n_prune, counts[k].n_grad, counts[k].n_rand]
                                      for k in names]
  return state.replace(method_state=MSTState(counts=jnp.asarray(table)))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _step(m: MST, tx, state: TrainState, grads):
  """What s24jax/training/train.py:train_step does with the step's raw gradients: the optimizer (MST's
  gradient mask first) with the step's extra arguments, then method.update(before, after,
  raw grads, info) with the StepInfo of the step state.step (logged)."""
  updates, opt_state = tx.update(grads, state.opt_state, state.params, method=m,
                                 sparsity=state.sparsity, method_state=state.method_state)
  after = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                        opt_state=opt_state)
  return m.update(state, after, grads, StepInfo(step=state.step, log=True))


def _adam(opt_state) -> optax.ScaleByAdamState:
  """Adam's state (count, mu, nu) in an optimizer state."""
  return [s for s in opt_state if isinstance(s, optax.ScaleByAdamState)][0]


def _assert_trees_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


# The hand-made 2 x 5 layer: 6 active weights (flat 1, 2, 4, 5, 7, 8), no ties.
W = np.array([[0.0, 0.9, -0.1, 0.0, 0.5], [0.3, 0.0, -0.7, 0.2, 0.0]], np.float32)
G = np.array([[0.05, 0.0, 0.8, 0.01, 0.0], [0.0, 0.6, 0.0, 0.0, 0.02]], np.float32)
HAND = counts_lib.LayerCounts(n_prune=3, n_grad=2, n_rand=1, n_before=6, n_after=6)


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
  assert counts_lib.layer_counts(_method(), 10, 6, 0.5, 0.4, 0.4) == HAND
  new, info = topology.update_layer_mask(jnp.asarray(W), jnp.asarray(m), jnp.asarray(G), 3, 2, 1,
                                    jnp.asarray(_u_first(8)))
  flat = lambda x: sorted(np.flatnonzero(np.asarray(x)).tolist())   # pylint: disable=unnecessary-lambda-assignment
  assert flat(info["dropped"]) == [2, 5, 8]
  assert flat(info["grown_gradient"]) == [2, 6]
  assert flat(info["grown_random"]) == [8]
  assert flat(info["regrown_dropped"]) == [2, 8]
  assert flat(new) == [1, 2, 4, 6, 7, 8]
  # regrow_dropped=False: candidates are the 4 entries inactive before ([0, 3, 6, 9]); by
  # gradient flat 6 (0.6) and 0 (0.05); at random among [3, 9] the keys pick 9.
  new, info = topology.update_layer_mask(jnp.asarray(W), jnp.asarray(m), jnp.asarray(G), 3, 2, 1,
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
  f = jax.jit(jax.vmap(lambda k: topology.update_layer_mask(
      w, mask, jnp.zeros((6, 8)), 0, 0, 6, topology.random_keys(k, 48))[1]["grown_random"]))
  counts = np.asarray(f(keys)).sum(0).reshape(-1)                  # 6 grown per key
  assert counts[mask.reshape(-1)].sum() == 0
  p = 6 / 24
  expect, sd = 4000 * p, math.sqrt(4000 * p * (1 - p))
  assert np.all(np.abs(counts[~mask.reshape(-1)] - expect) < 5 * sd)


def test_update_step_values_moments_and_the_skipped_optimizer_step():
  """The hand case as the update of step Delta, through the optimizer and `update` as the
  train step runs them: kept and regrown-dropped weights keep their value, the new one starts
  at 0; the optimizer step is undone (Adam moments and count as before the step, only the lr
  schedule count advances); the plan is read, not consumed. A step that is not an update step
  is the optimizer step on the masked gradients."""
  m = _method()   # Delta = 100, T = 1000
  state, tx = _synthetic({"L": W}, {"L": W != 0}, m)
  grads = {"L": {"kernel": jnp.asarray(G)}}
  # A first ordinary step (step 0: never an update) gives non-zero moments.
  state, metrics = _step(m, tx, state, grads)
  assert int(state.step) == 1 and np.isnan(float(metrics["mst/dropped"]))
  # Back to the hand weights, at step Delta, the plan's first row the hand counts.
  due = _with_plan(state.replace(step=jnp.asarray(100, jnp.int32),
                                 params={"L": {"kernel": jnp.asarray(W)}}), m, {100: {"L": HAND}})
  u = np.asarray(topology.random_keys(jax.random.fold_in(topology.update_rng(due), 0), 10))
  out, metrics = _step(m, tx, due, grads)
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
  adam, sched = _adam(out.opt_state), out.opt_state[-1]
  np.testing.assert_array_equal(np.asarray(adam.mu["L"]["kernel"]),
                                np.asarray(_adam(due.opt_state).mu["L"]["kernel"]))
  np.testing.assert_array_equal(np.asarray(adam.nu["L"]["kernel"]),
                                np.asarray(_adam(due.opt_state).nu["L"]["kernel"]))
  assert int(adam.count) == int(_adam(due.opt_state).count) == 1   # Adam did not step
  assert int(sched.count) == 2 and int(out.step) == 101            # the lr schedule did
  # No host writes: the plan leaves the step as it came.
  np.testing.assert_array_equal(np.asarray(out.method_state.counts),
                                np.asarray(due.method_state.counts))
  # Option reset_moments: zero moments exactly where the mask changed.
  r = dataclasses.replace(m, reset_moments=True)
  out_r, _ = _step(r, tx, due, grads)
  changed = mask != (W != 0)
  mu = np.asarray(_adam(out_r.opt_state).mu["L"]["kernel"])
  assert (mu[changed] == 0).all()
  np.testing.assert_array_equal(mu[~changed], np.asarray(_adam(due.opt_state).mu["L"]["kernel"])[
      ~changed])
  # Option train_on_update_step: the optimizer step is kept (Adam count 2), the update then
  # applies to the stepped weights.
  t = dataclasses.replace(m, train_on_update_step=True)
  out_t, _ = _step(t, tx, due, grads)
  assert int(_adam(out_t.opt_state).count) == 2
  np.testing.assert_array_equal(np.asarray(out_t.sparsity["L"]["mask"]), nm["L"])
  # Step 1 is no update step: the optimizer step on the masked gradient (G is non-zero at
  # pruned entries 0, 3, 6, 9: they neither move nor get moments), masks unchanged.
  plain, metrics = _step(m, tx, state, grads)
  adam_tx = optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(lambda c: 1e-2))
  updates, want_opt = adam_tx.update(state_lib.mask_sparse_kernels(grads, state.sparsity),
                                     tuple(state.opt_state[1:]), state.params)
  want = state_lib.mask_sparse_kernels(optax.apply_updates(state.params, updates),
                                       state.sparsity)
  np.testing.assert_allclose(np.asarray(plain.params["L"]["kernel"]),
                             np.asarray(want["L"]["kernel"]), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6),
               tuple(plain.opt_state[1:]), want_opt)
  assert (np.asarray(plain.params["L"]["kernel"])[W == 0] == 0).all()
  assert (np.asarray(_adam(plain.opt_state).mu["L"]["kernel"])[W == 0] == 0).all()
  np.testing.assert_array_equal(np.asarray(plain.sparsity["L"]["mask"]), W != 0)
  assert int(plain.step) == 2 and np.isnan(float(metrics["mst/dropped"]))


def test_synthetic_layers_match_the_reference_step_for_step():
  """Three layers (ER with unequal shapes), 9 updates at T = 1000: 0.5, then 0.7 from step 200,
  then 0.4 from 700 (sparsify, swap, densify). Between updates the weights move (a random walk
  on the active entries); at each update both implementations get the same weights, masks,
  dense gradients and random keys, and must agree on masks and weights. The counts the device
  reads come from the plan made up front; planning from the masks measured before each update
  gives the same counts, and the masks reach the plan's active counts."""
  m = _method(1000, target_sparsity=0.5, ultra_sparsity=0.7, final_sparsity=0.4,
              phase_fractions=(0.2, 0.5, 0.3))
  shapes = {"a": (25, 82), "b": (16, 40), "c": (48, 12)}
  names = densities.reference_order(shapes)
  ordered = {k: shapes[k] for k in names}
  plan = m.plan(shapes)
  assert plan.steps == tuple(range(100, 1000, 100))
  rng = np.random.default_rng(0)
  sch = ref.ReferenceScheduler(ordered, 0.5, t_end=1000, delta=100, zeta=0.3, grow_ratio=3)
  init_u = {k: rng.permutation(int(np.prod(s))) for k, s in shapes.items()}
  masks = sch.initial_masks(init_u)
  w = {k: (rng.standard_normal(s) * masks[k]).astype(np.float32) for k, s in shapes.items()}
  state, tx = _synthetic(w, masks, m)
  paths = state_lib.sparse_layer_paths(state.sparsity)
  state = state.replace(method_state=MSTState(
      counts=jnp.asarray(plan.table([state_lib.layer_name(p) for p in paths]))))
  n_active = {k: int(v.sum()) for k, v in masks.items()}
  assert n_active == counts_lib.initial_counts(m, ordered, 1000) == plan.first
  n_regrown = 0
  for i, it in enumerate(plan.steps):
    # The weights before the update (pruned ones exactly 0), the step's dense gradient.
    mask_now = {k: np.asarray(state.sparsity[k]["mask"]) for k in shapes}
    w = {k: (rng.standard_normal(s) * mask_now[k]).astype(np.float32)
         for k, s in shapes.items()}
    g = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    state = state.replace(step=jnp.asarray(it, jnp.int32),
                          params={k: {"kernel": jnp.asarray(v)} for k, v in w.items()})
    measured, _ = counts_lib.plan_update(m, ordered, {k: int(v.sum()) for k, v in
                                                      mask_now.items()}, it, 1000)
    assert measured == plan.counts[i], it
    counts = plan.counts[i]
    grads = {k: {"kernel": jnp.asarray(v)} for k, v in g.items()}
    out, _ = _step(m, tx, state, grads)
    keys = {p[0]: np.asarray(topology.random_keys(
        jax.random.fold_in(topology.update_rng(state), j), int(np.prod(shapes[p[0]]))))
            for j, p in enumerate(paths)}
    target = schedule.target_sparsity(m, it, 1000)
    ref_masks, ref_w, info = sch.update(it, target, w, mask_now, g,
                                        random_perms=ref.perm_from_keys(keys))
    for k in shapes:
      np.testing.assert_array_equal(np.asarray(out.sparsity[k]["mask"]), ref_masks[k], k)
      np.testing.assert_array_equal(np.asarray(out.params[k]["kernel"]), ref_w[k], k)
      assert counts[k].n_prune == info[k]["n_prune"] and counts[k].n_grad == info[k]["n_grad"]
      n_regrown += int(info[k]["regrown_dropped"].sum())
    assert {k: int(np.asarray(out.sparsity[k]["mask"]).sum()) for k in shapes} == (
        plan.active_after()[it])
    state = out
  assert n_regrown > 0    # the run exercised regrowth of just-dropped entries
  assert sch.sparsity == pytest.approx(1 - sum(int(np.asarray(state.sparsity[k]["mask"]).sum())
                                               for k in shapes) / sum(
                                                   int(np.prod(s)) for s in shapes.values()))


# ---------------------------------------------------------------------------------------------
# The tiny GPT-2 (all block linears and the tied head sparse), trained by the real train step.


class _Recording(MST):
  """MST that also returns the step's raw gradients and pre-step params as metrics."""

  def update(self, before, after, grads, info):
    state, metrics = super().update(before, after, grads, info)
    return state, {**metrics, "raw_grads": grads, "before": before.params}


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
  plain = registry.from_config(c)
  method = _Recording(**{f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)})
  model_cfg = model_lib.model_config(c, method)
  model = model_lib.GPT2(model_cfg)

  def tx_fn(params, sparsity):
    return optim.make_optimizer(c, state_lib.is_sparse_kernel(params, sparsity), method)

  state = jax.jit(lambda: train.fresh_state(model, tx_fn, c.seed))()
  return c, method, model, tx_fn(state.params, state.sparsity), state


class _Context:
  """What the loop shows a chore (chores.Context), in the sparse phase; records its
  writes."""
  sparse_phase = True

  def __init__(self, state):
    self.state, self.scalars, self.last_log, self.workdir = state, [], {}, ""
    self.info = StepInfo(step=0, log=True)

  def write(self, step, scalars):
    self.scalars.append((step, scalars))


def _batch(c, seed):
  tokens = np.random.default_rng(seed).integers(0, c.model.vocab_size,
                                                (c.batch_size, c.model.seq_len + 1))
  return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
          "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


def test_init_random_mask_matches_the_reference():
  c, method, model, _, state = _tiny()
  shapes = densities.layer_shapes(state.params, state.sparsity)
  assert list(shapes) == ["h_0/attn/qkv", "h_0/attn/out", "h_0/mlp/fc", "h_0/mlp/proj", "wte"]
  assert shapes["wte"] == (c.model.vocab_size, c.model.d_model)
  # init_state on the same fresh params with a chosen key, against the reference's draw.
  variables = model.init(jax.random.PRNGKey(1), jnp.zeros((1, c.model.seq_len), jnp.int32))
  params, sparsity, method_state = method.init_state(flax_unfreeze(variables["params"]),
                                                     flax_unfreeze(variables["sparsity"]),
                                                     jax.random.PRNGKey(7))
  s0 = densities.layer_sparsities(shapes, 0.5)
  perms = {}
  for j, p in enumerate(state_lib.sparse_layer_paths(sparsity)):
    u = np.asarray(topology.random_keys(jax.random.fold_in(jax.random.PRNGKey(7), j),
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
  # The method state is the run's plan, layers in sparse_layer_paths order.
  paths = state_lib.sparse_layer_paths(sparsity)
  np.testing.assert_array_equal(np.asarray(method_state.counts), method.plan(shapes).table(
      [state_lib.layer_name(p) for p in paths]))
  # The head is the sparsest layer (ER), and the model's lookup and head use one table.
  assert s0["wte"] == max(s0.values())
  # init='dense' keeps every weight.
  _, sp, _ = dataclasses.replace(method, init="dense").init_state(
      flax_unfreeze(variables["params"]), flax_unfreeze(variables["sparsity"]),
      jax.random.PRNGKey(7))
  assert all(bool(state_lib.get_path(sp, p)["mask"].all())
             for p in state_lib.sparse_layer_paths(sp))


def test_tiny_model_matches_the_reference_step_for_step():
  """16 steps, updates at 3, 6, 9, 12, 15 (targets 0.5, 0.7, 0.7, 0.4, 0.4): the real train
  step, the method's before-step chore (logging the plan), and at every update the reference
  fed the same pre-update weights, masks, the step's raw gradients and random keys. Masks and
  sparse weights must agree; the device updates exactly on those steps and reaches the plan's
  active counts (which planning from the measured masks, the old host hook's way, also
  gives); on update steps no parameter moves except through the mask; the FLOP plan's counts
  are the run's."""
  c, method, model, tx, state = _tiny()
  total = c.total_steps
  shapes = densities.layer_shapes(state.params, state.sparsity)
  paths = state_lib.sparse_layer_paths(state.sparsity)
  by_name = {state_lib.layer_name(p): p for p in paths}
  sch = ref.ReferenceScheduler(shapes, 0.5, t_end=total, delta=3, zeta=0.3, grow_ratio=3)
  ctx = _Context(state)
  log_plan = [h for h in method.chores(base.RunFacts.from_config(c)) if h.before_step][0]
  batch = _batch(c, 0)
  plan = method.plan(shapes)
  assert plan.steps == (3, 6, 9, 12, 15)
  history = plan.active_after()
  np.testing.assert_array_equal(np.asarray(state.method_state.counts),
                                plan.table(list(by_name)))
  active = lambda st: {state_lib.layer_name(p): int(  # pylint: disable=unnecessary-lambda-assignment
      state_lib.get_path(st.sparsity, p)["mask"].sum()) for p in paths}
  assert active(ctx.state) == plan.first
  n_updates, n_regrown, measured_after = 0, 0, {}
  for step in range(total):
    ctx.info = StepInfo(step=step, log=True)
    due = log_plan.is_due(ctx.info, total)
    # The chore and the device ask the same rule; off the log it is due all the same.
    assert due == log_plan.is_due(StepInfo(step=step, log=False), total)
    if due:
      log_plan.fn(ctx)
    before = ctx.state
    n_before = active(before)
    if due:   # the counts the device reads = the counts planned from the measured masks
      counts, _ = counts_lib.plan_update(method, shapes, n_before, step, total)
      assert counts == plan.counts[plan.steps.index(step)], step
    masks_before = {n: np.asarray(state_lib.get_path(before.sparsity, p)["mask"])
                    for n, p in by_name.items()}
    keys = {state_lib.layer_name(p): np.asarray(topology.random_keys(
        jax.random.fold_in(topology.update_rng(before), i),
        masks_before[state_lib.layer_name(p)].size))
            for i, p in enumerate(paths)} if due else None
    before_copy = jax.tree.map(np.asarray, before)
    ctx.state, metrics = train.train_step(before, batch, model=model, tx=tx)
    assert due == (step in (3, 6, 9, 12, 15))
    # The device's own decision: the update ran on exactly these steps.
    assert np.isnan(float(metrics["mst/dropped"])) == (not due), step
    if not due:
      assert active(ctx.state) == n_before
      continue
    n_updates += 1
    w = {n: np.asarray(base_weight(metrics["before"], p)) for n, p in by_name.items()}
    g = {n: np.asarray(base_weight(metrics["raw_grads"], p)) for n, p in by_name.items()}
    ref_masks, ref_w, info = sch.update(step, schedule.target_sparsity(method, step, total), w,
                                        masks_before, g, random_perms=ref.perm_from_keys(keys))
    for n, p in by_name.items():
      np.testing.assert_array_equal(np.asarray(state_lib.get_path(ctx.state.sparsity, p)["mask"]),
                                    ref_masks[n], n)
      np.testing.assert_array_equal(np.asarray(base_weight(ctx.state.params, p)), ref_w[n], n)
      n_regrown += int(info[n]["regrown_dropped"].sum())
    # The skipped step: dense parameters and Adam's state as before.
    np.testing.assert_array_equal(np.asarray(ctx.state.params["ln_f"]["scale"]),
                                  before_copy.params["ln_f"]["scale"])
    np.testing.assert_array_equal(np.asarray(ctx.state.params["wpe"]), before_copy.params["wpe"])
    _assert_trees_equal(_adam(ctx.state.opt_state), _adam(before_copy.opt_state))
    assert active(ctx.state) == history[step]
    measured_after[step] = 1 - sum(active(ctx.state).values()) / sum(
        int(np.prod(s)) for s in shapes.values())
  assert n_updates == 5 and n_regrown > 0
  assert sch.sparsity == pytest.approx(measured_after[15])
  # The host scalars the chore logged: the planned sparsity after each update, which the
  # masks reached.
  assert [s for s, _ in ctx.scalars] == [3, 6, 9, 12, 15]
  for s, scalars in ctx.scalars:
    assert scalars["mst/sparsity"] == pytest.approx(measured_after[s], abs=1e-12), s
  # FLOPs: the planned run's counts are these; update steps compute the dense weight gradient.
  acct = flops.planned(RunSpec.build(c))
  assert acct.steps == total and acct.nnz == active(ctx.state)


def test_growth_gradient_is_the_dense_gradient_at_w_tilde():
  """The raw gradient `update` sees is dL/dW~ of the step's mean loss, dense (pruned entries
  included), tied head and embedding summed: it equals the gradient of the dense model
  evaluated at W~ = mask * W. The logged grad_norm is its norm (the mask is in the
  optimizer)."""
  c, method, model, tx, state = _tiny()
  batch = _batch(c, 1)
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
  assert float(metrics["grad_norm"]) == pytest.approx(
      float(optax.tree.norm(metrics["raw_grads"])), rel=1e-6)
  del method


def test_resumed_state_makes_the_same_update(tmp_path):
  """Orbax round trip of the state before the update of step 3, restored into a new fresh
  state as the loop does: the fresh state plans the same, and the resumed run makes the same
  steps (same draws) through the updates of steps 3 and 6."""
  c, method, model, tx, state = _tiny()
  batch = _batch(c, 2)
  for _ in range(3):
    state, _ = train.train_step(state, batch, model=model, tx=tx)
  assert int(state.step) == 3 and method.update_due(3)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(3, state, force=True)
  ckpt.close()
  _, _, _, _, fresh = _tiny()
  np.testing.assert_array_equal(np.asarray(fresh.method_state.counts),
                                np.asarray(state.method_state.counts))
  restored = ckpt_lib.Checkpointer(str(tmp_path)).restore_or_init(fresh)
  assert int(restored.step) == 3
  np.testing.assert_array_equal(np.asarray(restored.method_state.counts),
                                np.asarray(state.method_state.counts))
  a, b = jax.tree.map(jnp.copy, state), restored
  for step in range(3, 7):
    a, ma = train.train_step(a, batch, model=model, tx=tx)
    b, mb = train.train_step(b, batch, model=model, tx=tx)
    assert (float(ma["mst/dropped"]) > 0) == (step in (3, 6)), step
    _assert_trees_equal(a, b)
    _assert_trees_equal({k: v for k, v in ma.items() if k.startswith("mst/")},
                        {k: v for k, v in mb.items() if k.startswith("mst/")})


def test_active_weights_count_the_sparse_head_and_dense_weight_gradients():
  c, method, _, _, _ = _tiny()
  spec = RunSpec.build(c)
  model_cfg, shapes, masked = spec.model_cfg, spec.kernel_shapes, spec.sparse_shapes
  assert set(masked) == set(shapes) | {"wte"} and masked["wte"] == (c.model.vocab_size,
                                                                   c.model.d_model)
  plan = counts_lib.plan(method, tuple((k, masked[k]) for k in densities.reference_order(masked)),
                         c.total_steps)
  first, history = plan.first, plan.active_after()
  assert method.active_weights(0, masked) == (first, False)
  assert method.active_weights(3, masked) == (None, True)       # old masks, dense dW
  assert method.active_weights(4, masked) == (history[3], False)
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


def test_update_due_is_one_rule_on_ints_and_traced_steps():
  """MST.update_due answers the same on host ints (the plan, the chores) and on traced int32
  steps (the device's update under jit), for every step of a run and beyond; the reference
  rule written out: t > 0, t < T, Delta | t."""
  for delta, total in ((100, 1000), (3, 16), (7, 50), (1, 5)):
    m = _method(total, update_every=delta)
    steps = np.arange(-3, total + 2 * delta + 2)
    host = [bool(m.update_due(int(t))) for t in steps]
    traced = jax.jit(jax.vmap(m.update_due))(jnp.asarray(steps, jnp.int32))
    assert np.asarray(traced).dtype == np.bool_
    np.testing.assert_array_equal(np.asarray(traced), host)
    one = jax.jit(m.update_due)
    assert [bool(one(jnp.int32(t))) for t in steps[:40]] == host[:40]   # scalars, one by one
    want = [0 < t < total and t % delta == 0 for t in steps]
    assert host == want
    # With the run's total given explicitly, traced too.
    explicit = jax.jit(lambda t, m=m, total=total: m.update_due(t, total))
    np.testing.assert_array_equal(np.asarray(jax.vmap(explicit)(jnp.asarray(steps, jnp.int32))),
                                  want)
