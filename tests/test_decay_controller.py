"""The lambda_W warm-up controller (methods/sr_ste.py, docs/algorithms.md "Choosing lambda_W in
warm-up"): synthetic flip-rate sequences through the jitted `control`, against a plain-Python
statement of the documented rule; the freeze report; the defaults; and real tiny training runs
(sr_ste, t_sr_ste) whose controller follows the rule on the rate it steers on."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax import config_files
from s24jax import loop
from s24jax import train
from s24jax.model import GPT2
from s24jax.methods import registry
from s24jax.methods import sr_ste

from tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
  ctx = types.SimpleNamespace(state=types.SimpleNamespace(method_state=ctrl), step=200,
                              write=lambda step, m: written.update(m))
  method._log_chosen_decay(ctx)   # pylint: disable=protected-access
  return warnings, written


def test_the_freeze_says_what_happened(monkeypatch):
  m = _controller("t_sr_ste")
  ctrl, _, _ = _drive(m, lambda lam, s: 20 * TARGET, range(200))
  warnings, written = _freeze(m, ctrl, monkeypatch)
  assert written["sparsity/decay_stopped_unresponsive"] == 1.0
  assert written["sparsity/decay_chosen"] == pytest.approx(START)
  assert written["sparsity/decay_band_reached"] == 0.0 and written["sparsity/decay_rounds"] == 2
  assert len(warnings) == 1
  assert "from 0.0001 to 0.0002" in warnings[0] and "flip_rate_transposable" in warnings[0]
  # Raised into the band: no warning.
  ctrl, _, _ = _drive(m, lambda lam, s: 20 * TARGET * START / lam, range(200))
  warnings, written = _freeze(m, ctrl, monkeypatch)
  assert not warnings and written["sparsity/decay_band_reached"] == 1.0
  assert written["sparsity/decay_stopped_unresponsive"] == 0.0
  assert written["sparsity/decay_chosen"] == pytest.approx(16 * START)
  # Still above the band at the cap: warned.
  ctrl, _, _ = _drive(m, lambda lam, s: 1000 * TARGET * (START / lam) ** 0.5, range(200))
  warnings, _ = _freeze(m, ctrl, monkeypatch)
  assert len(warnings) == 1 and "still above the band" in warnings[0]


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
  ste = registry.from_config(tiny_config("ste", sparsity__sr_ste__decay_auto=True))
  assert ste.name == "ste" and _start(ste) == {} and not getattr(ste, "controlled", False)


# ---------------------------------------------------------------------------------------------
# In training.


def _batch(rng):
  tokens = rng.integers(0, 64, size=(4, 17))
  return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


@pytest.mark.parametrize("name", ["sr_ste", "t_sr_ste"])
def test_in_training_the_controller_follows_the_rule_on_the_rate_it_steers_on(name):
  """Window [6, 12) in rounds of 2 steps (each judged on its second): lambda_W after every
  step is the rule's, replayed on the steered rate the steps logged."""
  config = tiny_config(name, steps=14, optim__lr=3e-2, **{
      f"sparsity__{name}__decay_auto": True, f"sparsity__{name}__decay_auto_steps": 12,
      f"sparsity__{name}__decay_auto_every": 2, f"sparsity__{name}__decay_auto_target": 1e-4})
  config.model.vocab_size = 64
  method = registry.from_config(config)
  assert method.steer_on == {"sr_ste": "flip_rate", "t_sr_ste": "flip_rate_transposable"}[name]
  _, model_cfg, tx_fn = loop.build(config)
  model = GPT2(model_cfg)
  state = train.fresh_state(model, tx_fn, config.seed)
  tx = tx_fn(state.params, state.sparsity)
  rng, lams, rates = np.random.default_rng(2), [], []
  for _ in range(14):
    state, metrics = train.train_step(state, _batch(rng), model=model, tx=tx)
    # the lambda this step used is the controller's value before the step
    assert float(metrics["sparsity/decay"]) == pytest.approx(lams[-1] if lams else 6e-5)
    lams.append(float(state.method_state.decay))
    rates.append(float(metrics[method.steer_on]))
  assert all(0 <= r <= 1 for r in rates)                 # measured at every step here
  np.testing.assert_allclose(lams, _reference(rates, range(14), method), rtol=1e-5)
  assert int(state.method_state.rounds) == 3


def test_a_t_sr_ste_run_logs_both_flip_rates_and_the_freeze(tmp_path, data_cache):
  config = tiny_config("t_sr_ste", steps=8, workdir_cache=data_cache,
                       sparsity__t_sr_ste__decay_auto=True, sparsity__t_sr_ste__decay_auto_steps=6,
                       sparsity__t_sr_ste__decay_auto_every=1)
  config.log_every = 4   # steps 1-3 outside the window and off the log: not measured
  loop.train_and_evaluate(config, str(tmp_path))
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  logs = {r["step"]: r for r in records if "train/loss" in r}
  assert set(logs) == {4, 8}
  for r in logs.values():
    assert 0 <= r["train/flip_rate"] <= 1 and 0 <= r["train/flip_rate_transposable"] <= 1
    assert "train/flip_rate_transposable/h_0/mlp/fc" in r
  freeze = next(r for r in records if "sparsity/decay_chosen" in r)
  assert freeze["step"] == 6 and freeze["sparsity/decay_rounds"] == 3
  assert freeze["sparsity/decay_stopped_unresponsive"] in (0.0, 1.0)
