"""Tests for s24jax/methods/sr_ste.py (docs/algorithms.md, "SR-STE" and "Choosing lambda_W in
warm-up").

- The projection: forward the hard 2:4 mask (a NumPy top-2 of every 4), backward the
  straight-through gradient plus lambda_W (1 - m) W only in the 'backward' placement (NumPy).
- `masked_decay` (the optax transform of the two Adam placements) reads the stored forward
  mask, not nm_mask(W), and does nothing in a dense step; `forward_masks` covers the tied head.
- The lambda_W warm-up controller: synthetic flip-rate sequences through the jitted `control`,
  against a plain-Python statement of the documented rule (`_reference`); the freeze report;
  the defaults; and tiny training steps (sr_ste, t_sr_ste) whose controller follows the rule on
  the rate it steers on (t_sr_ste's run through the loop: tests/methods/test_t_sr_ste.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax import config_files
from s24jax.training import train
from s24jax.kernels import masks
from s24jax.methods import base
from s24jax.methods import registry
from s24jax.methods import sr_ste
from s24jax.step_info import StepInfo

from tiny import tiny_config

from method_helpers import fresh_model_state, fwd_bwd, np_mask24, rand, random_batch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# ---------------------------------------------------------------------------------------------
# The projection and the masked decay.


@pytest.mark.parametrize("placement,lam", [("backward", 0.3), ("gradients", 0.3),
                                           ("weights", 0.3), ("backward", 0.0)])
def test_sr_ste_backward_adds_masked_decay_only_in_backward_placement(placement, lam):
  w = rand(2)
  y, dw, g, _ = fwd_bwd("sr_ste", w, decay=lam, decay_placement=placement)
  m = np_mask24(w)
  np.testing.assert_array_equal(y, np.where(m, w, 0))
  expected = g + (lam * (~m) * w if placement == "backward" else 0.0)
  np.testing.assert_allclose(dw, expected, rtol=1e-6, atol=1e-7)


def test_backward_decay_is_a_python_float_only_in_the_backward_placement():
  m = registry.get_method("sr_ste")
  for placement, want in (("backward", 0.3), ("gradients", 0.0), ("weights", 0.0)):
    got = dataclasses.replace(m, decay=0.3, decay_placement=placement).backward_decay()
    assert type(got) is float and got == want, placement


def test_sr_ste_forward_masks_cover_the_tied_head():
  """The masked decay's mask tree holds the head's mask at ('wte', 'embedding') (it was
  built with 'kernel' hard-coded, and None there crashed the first step)."""
  params = {"wte": {"embedding": jnp.ones((8, 4))},
            "h_0": {"mlp": {"fc": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(4)}}}}
  sparsity = {"wte": {"mask": jnp.eye(8, 4, dtype=bool)},
              "h_0": {"mlp": {"fc": {"mask": jnp.ones((4, 8), bool)}}}}
  tree = sr_ste.forward_masks(params, sparsity)
  np.testing.assert_array_equal(tree["wte"]["embedding"], sparsity["wte"]["mask"])
  np.testing.assert_array_equal(tree["h_0"]["mlp"]["fc"]["kernel"],
                                sparsity["h_0"]["mlp"]["fc"]["mask"])
  assert tree["h_0"]["mlp"]["fc"]["bias"] is None


def test_masked_decay_uses_the_mask_the_forward_used():
  """sr_ste.masked_decay reads the stored forward mask (a cached one), not nm_mask(W), and
  lambda_W from the method; it does nothing in a step whose model is dense."""
  w = _normal(11, (4, 8))
  params = {"k": {"kernel": w, "bias": jnp.ones(3)}}
  is_sparse = {"k": {"kernel": True, "bias": False}}
  cached = masks.nm_mask(_normal(12, (4, 8)))                     # differs from nm_mask(w)
  assert (cached != masks.nm_mask(w)).any()
  method = dataclasses.replace(registry.get_method("sr_ste"), decay=0.25)
  tx = sr_ste.masked_decay(method, is_sparse)
  sparsity = {"k": {"mask": cached}}
  zeros = jax.tree.map(jnp.zeros_like, params)
  upd, _ = tx.update(zeros, tx.init(params), params, method=method, sparsity=sparsity,
                     method_state={})
  np.testing.assert_allclose(upd["k"]["kernel"], 0.25 * np.where(cached, 0, w), rtol=1e-6)
  np.testing.assert_array_equal(upd["k"]["bias"], 0)
  ones = jax.tree.map(jnp.ones_like, params)
  dense = registry.get_method("dense")                             # a dense fine-tuning step
  upd, _ = tx.update(ones, tx.init(params), params, method=dense, sparsity=sparsity,
                     method_state={})
  np.testing.assert_array_equal(upd["k"]["kernel"], 1)
  np.testing.assert_array_equal(upd["k"]["bias"], 1)
  with pytest.raises(ValueError, match="sparsity collection"):    # no forward masks given
    tx.update(zeros, tx.init(params), params, method=method)


# ---------------------------------------------------------------------------------------------
# The lambda_W warm-up controller, on synthetic flip rates.

TARGET = 1e-2                 # band [5e-3, 2e-2]
START = 1e-4


def _controller(name="sr_ste", **fields):
  """A controlled method: window [100, 200) = 10 rounds of 10 steps, measured on 5 each."""
  fields = {"decay": START, "decay_auto": True, "decay_auto_target": TARGET,
            "decay_auto_steps": 200, **fields}
  return dataclasses.replace(registry.get_method(name), **fields)


def _start(method):
  return method.init_state({}, {}, jax.random.key(0))[2]


def _reference(rates, steps, m):
  """Plain-Python statement of the documented rule: lambda_W after each step."""
  n, k = m.decay_auto_steps, m.decay_auto_every
  hi, lo = m.decay_auto_target * m.decay_auto_band, m.decay_auto_target / m.decay_auto_band
  cap = min(m.decay * sr_ste.MAX_GROWTH, sr_ste.MAX_DECAY)
  lam, before, rate_before, raised, stopped, acc, out = m.decay, m.decay, None, False, False, [], []
  for step, r in zip(steps, rates):
    pos = step - n // 2
    if pos >= 0 and step < n:
      if pos % k >= k // 2 and not math.isnan(r):
        acc.append(r)
      if pos % k == k - 1:
        if acc and not stopped:
          mean = sum(acc) / len(acc)
          if mean > hi and raised and mean > rate_before * (1 - m.decay_auto_min_response):
            lam, stopped, raised = before, True, False       # the raise did nothing: undo
          elif mean > hi and lam < cap:
            before, rate_before, raised = lam, mean, True
            lam = min(lam * m.decay_auto_rate, cap)
          else:
            raised = False
            if mean < lo:
              lam = max(lam / m.decay_auto_rate, sr_ste.MIN_DECAY)
        acc = []
    out.append(lam)
  return out


def _drive(method, rate_of, steps, ctrl=None):
  """Runs the jitted controller over `steps`, the flip rate of a step = rate_of(lambda_W the
  step used, step). Returns the final state, the lambdas and the rates."""
  ctrl = _start(method) if ctrl is None else ctrl
  update = jax.jit(method.control)
  lams, rates = [], []
  for step in steps:
    r = rate_of(float(ctrl.decay), step)
    ctrl = update(ctrl, jnp.float32(r), jnp.int32(step))
    lams.append(float(ctrl.decay))
    rates.append(r)
  return ctrl, lams, rates


def _all(values, expected):
  return values == pytest.approx([expected] * len(values), rel=1e-6)


def _round_ends(lams):
  """lambda_W after each of the 10 rounds of [100, 200) (lams indexed from step 0)."""
  return [lams[100 + 10 * j + 9] for j in range(10)]


def test_a_rate_that_falls_with_lambda_is_raised_into_the_band_then_held():
  m = _controller()
  # r = 20 x target at the start, proportional to 1 / lambda_W: four doublings reach the band.
  ctrl, lams, rates = _drive(m, lambda lam, s: 20 * TARGET * START / lam, range(230))
  np.testing.assert_allclose(lams, _reference(rates, range(230), m), rtol=1e-6)
  np.testing.assert_allclose(_round_ends(lams), START * np.array([2, 4, 8, 16] + [16] * 6),
                             rtol=1e-6)
  assert _all(lams[:109], START)   # nothing before the first round ends
  assert not bool(ctrl.stopped) and int(ctrl.rounds) == 10
  assert lams[-1] == lams[199]                           # frozen after the window


@pytest.mark.parametrize("rate_of", [
    lambda lam, s: 20 * TARGET,                                        # ignores lambda_W
    lambda lam, s: 20 * TARGET * (START / lam) ** 0.05,                # 3% lower per doubling
    lambda lam, s: 20 * TARGET * (1 + 0.02 * math.sin(1.7 * s)),       # noisy, unresponsive
], ids=["constant", "weak", "noisy"])
def test_a_rate_that_ignores_lambda_stops_the_controller_at_the_value_before_the_raise(rate_of):
  m = _controller()
  ctrl, lams, rates = _drive(m, rate_of, range(230))
  np.testing.assert_allclose(lams, _reference(rates, range(230), m), rtol=1e-6)
  raises = sum(b > a for a, b in zip(lams, lams[1:]))
  assert raises == 1                                     # one raise, one check, undone
  assert lams[-1] == pytest.approx(START) and max(lams) == pytest.approx(2 * START)
  assert bool(ctrl.stopped) and int(ctrl.rounds) == 2
  # Stopped for good: a later rate below the band no longer lowers it.
  ctrl, later, _ = _drive(m, lambda lam, s: TARGET / 100, range(130, 200), ctrl)
  assert _all(later, START)


def test_a_rate_below_the_band_lowers_lambda_every_round():
  m = _controller()
  ctrl, lams, rates = _drive(m, lambda lam, s: TARGET / 10, range(230))
  np.testing.assert_allclose(lams, _reference(rates, range(230), m), rtol=1e-6)
  np.testing.assert_allclose(_round_ends(lams), START / 2.0 ** np.arange(1, 11), rtol=1e-6)
  assert not bool(ctrl.stopped)
  # ... down to the floor.
  deep = _controller(decay=4e-8)
  _, lams, _ = _drive(deep, lambda lam, s: TARGET / 10, range(200))
  assert lams[-1] == pytest.approx(sr_ste.MIN_DECAY)


def test_nothing_happens_outside_the_second_half_of_the_window():
  m = _controller()
  steps = list(range(0, 100)) + list(range(200, 260))
  wild = lambda lam, s: [1.0, 0.0, float("nan")][s % 3]
  ctrl, lams, _ = _drive(m, wild, steps)
  assert _all(lams, START)
  assert int(ctrl.rounds) == 0 and float(ctrl.round_sum) == 0 and int(ctrl.round_count) == 0


def test_a_round_is_judged_on_its_second_half_and_a_cut_round_is_ignored():
  m = _controller(decay_auto_steps=205)   # window [102, 205): 10 rounds and a cut one
  # Huge rates in each round's first half (settling), in-band ones in its second: hold.
  settle = lambda lam, s: 1.0 if (s - 102) % 10 < 5 else TARGET
  _, lams, _ = _drive(m, settle, range(230))
  assert _all(lams, START)
  # A round without measurements (NaN) is not acted on.
  _, lams, _ = _drive(m, lambda lam, s: float("nan"), range(230))
  assert _all(lams, START)
  # The cut round [202, 205) never ends: its high rates change nothing.
  _, lams, _ = _drive(m, lambda lam, s: 1.0 if s >= 202 else TARGET, range(230))
  assert _all(lams, START)


def test_a_rate_that_responds_but_never_reaches_the_band_stops_at_the_cap():
  m = _controller()
  rate_of = lambda lam, s: 1000 * TARGET * (START / lam) ** 0.5    # -29% per doubling
  ctrl, lams, rates = _drive(m, rate_of, range(200))
  np.testing.assert_allclose(lams, _reference(rates, range(200), m), rtol=1e-6)
  assert max(lams) == pytest.approx(START * sr_ste.MAX_GROWTH)
  assert lams[-1] == pytest.approx(START * sr_ste.MAX_GROWTH) and not bool(ctrl.stopped)


def _freeze(method, ctrl, monkeypatch):
  warnings, written = [], {}
  monkeypatch.setattr(sr_ste.logging, "warning", lambda *a: warnings.append(a[0] % a[1:]))
  # The chore runs after the last step of the window [100, 200): step index 199.
  ctx = types.SimpleNamespace(state=types.SimpleNamespace(method_state=ctrl),
                              info=StepInfo(step=199, log=False),
                              write=lambda step, m: written.update(m))
  method._log_chosen_decay(ctx)   # pylint: disable=protected-access
  return warnings, written


def test_the_freeze_says_what_happened(monkeypatch):
  m = _controller("t_sr_ste")
  ctrl, _, _ = _drive(m, lambda lam, s: 20 * TARGET, range(200))
  warnings, written = _freeze(m, ctrl, monkeypatch)
  assert written["method/decay_stopped_unresponsive"] == 1.0
  assert written["method/decay_chosen"] == pytest.approx(START)
  assert written["method/decay_band_reached"] == 0.0 and written["method/decay_rounds"] == 2
  assert len(warnings) == 1
  assert "from 0.0001 to 0.0002" in warnings[0] and "flip_rate_transposable" in warnings[0]
  # Raised into the band: no warning.
  ctrl, _, _ = _drive(m, lambda lam, s: 20 * TARGET * START / lam, range(200))
  warnings, written = _freeze(m, ctrl, monkeypatch)
  assert not warnings and written["method/decay_band_reached"] == 1.0
  assert written["method/decay_stopped_unresponsive"] == 0.0
  assert written["method/decay_chosen"] == pytest.approx(16 * START)
  # Still above the band at the cap: warned.
  ctrl, _, _ = _drive(m, lambda lam, s: 1000 * TARGET * (START / lam) ** 0.5, range(200))
  warnings, _ = _freeze(m, ctrl, monkeypatch)
  assert len(warnings) == 1 and "still above the band" in warnings[0]



def test_the_freeze_chore_runs_once_after_the_window():
  """The chore that logs the chosen lambda_W is due after the window's last step only, and
  writes at the steps done then (200), the step the loop logs that step at."""
  m = _controller()
  facts = base.RunFacts.from_config(tiny_config("sr_ste", steps=300))
  frozen = [c for c in m.chores(facts) if c.name == "lambda_W frozen"]
  assert len(frozen) == 1 and not frozen[0].before_step
  due = [s for s in range(300) for log in (False, True)
         if frozen[0].is_due(StepInfo(step=s, log=log), 300)]
  assert due == [199, 199]
  ctrl, _, _ = _drive(m, lambda lam, s: TARGET, range(200))
  steps = []
  ctx = types.SimpleNamespace(state=types.SimpleNamespace(method_state=ctrl),
                              info=StepInfo(step=199, log=False),
                              write=lambda step, scalars: steps.append(step))
  frozen[0].fn(ctx)
  assert steps == [200]
  assert not [c for c in registry.get_method("sr_ste").chores(facts)
              if c.name == "lambda_W frozen"]     # no controller, no chore

def test_defaults_the_paper_value_and_decay_auto_selects_the_controller():
  c = config_files.load_config(os.path.join(REPO, "experiments", "gpt2_ste.py:small"),
                               {"sparsity.method": "sr_ste"})
  assert c.sparsity.sr_ste.decay == sr_ste.PAPER_DECAY["124m"] == 6e-5
  assert "decay_auto_init" not in c.sparsity.sr_ste
  for name in ("sr_ste", "t_sr_ste"):
    m = registry.get_method(name)
    assert m.decay == 6e-5 and m.uses_decay and not m.controlled and _start(m) == {}
    auto = dataclasses.replace(m, decay_auto=True)
    assert auto.controlled and float(_start(auto).decay) == pytest.approx(6e-5)
    plain = dataclasses.replace(m, decay=0.0)     # the explicit way to plain STE
    assert not plain.uses_decay and not plain.optimizer_transforms("gradients", {})
    with pytest.raises(ValueError, match=r"decay_auto starts lambda_W from .*decay, which"):
      dataclasses.replace(m, decay=0.0, decay_auto=True)
    with pytest.raises(ValueError, match="placement"):
      dataclasses.replace(m, decay_auto=True, decay_placement="backward")
  # ste takes no masked decay: decay_auto in a config whose method is ste gives no controller.
  ste = registry.from_config(tiny_config("ste",
                                         overrides={"sparsity.sr_ste.decay_auto": True}))
  assert ste.name == "ste" and _start(ste) == {} and not getattr(ste, "controlled", False)


def test_the_controller_window_is_the_second_half_of_decay_auto_steps():
  m = _controller()
  assert m.controller_window == (100, 200)
  inside = [s for s in range(260) if m.in_controller_window(s)]
  assert inside == list(range(100, 200))
  traced = jax.jit(jax.vmap(m.in_controller_window))(jnp.arange(260, dtype=jnp.int32))
  np.testing.assert_array_equal(np.asarray(traced), [100 <= s < 200 for s in range(260)])


# ---------------------------------------------------------------------------------------------
# In training.


@pytest.mark.parametrize("name", ["sr_ste", "t_sr_ste"])
def test_in_training_the_controller_follows_the_rule_on_the_rate_it_steers_on(name):
  """Window [6, 12) in rounds of 2 steps (each judged on its second): lambda_W after every
  step is the rule's, replayed on the steered rate the steps logged."""
  config = tiny_config(name, steps=14, overrides={
      "optim.lr": 3e-2, f"sparsity.{name}.decay_auto": True,
      f"sparsity.{name}.decay_auto_steps": 12, f"sparsity.{name}.decay_auto_every": 2,
      f"sparsity.{name}.decay_auto_target": 1e-4})
  config.model.vocab_size = 64
  method = registry.from_config(config)
  assert method.steer_on == {"sr_ste": "flip_rate", "t_sr_ste": "flip_rate_transposable"}[name]
  model, tx, state = fresh_model_state(config)
  rng, lams, rates = np.random.default_rng(2), [], []
  for _ in range(14):
    state, metrics = train.train_step(state, random_batch(rng), model=model, tx=tx)
    # the lambda this step used is the controller's value before the step
    assert float(metrics["method/decay"]) == pytest.approx(lams[-1] if lams else 6e-5)
    lams.append(float(state.method_state.decay))
    rates.append(float(metrics[method.steer_on]))
  assert all(0 <= r <= 1 for r in rates)                 # measured at every step here
  np.testing.assert_allclose(lams, _reference(rates, range(14), method), rtol=1e-5)
  assert int(state.method_state.rounds) == 3
