"""Tests for s24jax/methods/t_sr_ste.py (Hu et al. 2024; docs/algorithms.md, "Transposable
2:4 mask" and "Hu et al. 2024"): the cached transposable mask, refreshed every k steps or on
drift; its two flip rates, measured where the loop reads them; a run through the loop.

The references are NumPy counts over masks recomputed here from the weights the steps leave
(the plain 2:4 and the transposable mask of each step's W), and the step schedule stated
directly (k | steps done; the steps whose StepInfo says `log`), not the method's bookkeeping.
SR-STE's masked decay and lambda_W controller: tests/methods/test_sr_ste.py.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.training import loop
from s24jax import state as state_lib
from s24jax.training import train
from s24jax.kernels import masks
from s24jax.step_info import StepInfo
from s24jax.step_info import itstime

from tiny import tiny_config

from method_helpers import fresh_model_state, random_batch


def _tiny(method, overrides=None, **kwargs):
  c = tiny_config(method, overrides=overrides, **kwargs)
  c.model.vocab_size = 64
  return c


def test_t_sr_ste_mask_refreshed_exactly_every_k_steps_and_cached_between():
  k = 3
  config = _tiny("t_sr_ste", {"sparsity.t_sr_ste.mask_refresh_every": k, "sparsity.mvue": True,
                              "sparsity.t_sr_ste.decay": 1e-3, "optim.lr": 3e-2})
  model, tx, state = fresh_model_state(config)
  paths = state_lib.sparse_layer_paths(state.sparsity)
  assert [p[1:] for p in paths] == [("mlp", "fc"), ("mlp", "proj")]
  # Copies: train_step donates the state's buffers.
  kernels = lambda s: {p: np.asarray(state_lib.get_path(s.params, p)["kernel"]) for p in paths}
  cached = lambda s: {p: np.asarray(state_lib.get_path(s.sparsity, p)["mask"]) for p in paths}
  tmask = jax.jit(masks.transposable_mask)
  nm = jax.jit(masks.nm_mask)
  source = kernels(state)                        # the weights the cached mask was made from
  rng = np.random.default_rng(0)
  stale_seen = False
  for step in range(1, 2 * k + 2):
    prev, before = cached(state), kernels(state)
    state, metrics = train.train_step(state, random_batch(rng), model=model, tx=tx)
    now = kernels(state)
    # Every step: the paper's r_t, of the plain 2:4 mask of the latent W (NumPy count).
    flips = sum(int((np.asarray(nm(now[p])) != np.asarray(nm(before[p]))).sum()) for p in paths)
    total = sum(now[p].size for p in paths)
    np.testing.assert_allclose(float(metrics["flip_rate"]), flips / total, rtol=1e-6)
    assert float(metrics["mask_refresh/refreshed"]) == float(step % k == 0)
    if step % k == 0:
      source = now
      changed = sum(int((cached(state)[p] != prev[p]).sum()) for p in paths)
      np.testing.assert_allclose(float(metrics["mask_refresh/changed"]), changed / total,
                                 rtol=1e-6)
      assert 0.5 < float(metrics["transposable_kept_ratio"]) <= 1.0
    else:
      assert np.isnan(float(metrics["mask_refresh/changed"]))
      assert np.isnan(float(metrics["transposable_kept_ratio"]))
    for p in paths:
      want = np.asarray(tmask(source[p]))
      np.testing.assert_array_equal(cached(state)[p], want, err_msg=f"step {step} {p}")
      stale_seen |= step % k != 0 and (want != np.asarray(tmask(now[p]))).any()
  assert stale_seen   # the weights moved enough that caching made a difference
  # The forward uses the cached mask: the projected weight is exactly cached mask * W.
  proj = model.config.sparsity.method
  assert proj.name == "t_sr_ste"
  for p in paths:
    layer = state_lib.get_path(state.sparsity, p)
    wt = proj.project(jnp.asarray(kernels(state)[p]), layer)
    np.testing.assert_array_equal(np.asarray(wt), np.where(layer["mask"], kernels(state)[p], 0))


def test_t_sr_ste_drift_refresh_follows_the_weights():
  """With mask_refresh_drift the cache is refreshed as soon as the plain 2:4 mask of W has
  drifted more than the threshold from the one at the last refresh (a NumPy count), and at
  the latest every mask_refresh_every steps."""
  tau = 0.01
  config = _tiny("t_sr_ste", {"sparsity.t_sr_ste.mask_refresh_every": 1000,
                              "sparsity.t_sr_ste.mask_refresh_drift": tau, "optim.lr": 3e-2})
  model, tx, state = fresh_model_state(config)
  paths = state_lib.sparse_layer_paths(state.sparsity)
  kernels = lambda s: {p: np.asarray(state_lib.get_path(s.params, p)["kernel"]) for p in paths}
  nm = jax.jit(masks.nm_mask)
  tmask = jax.jit(masks.transposable_mask)
  at_refresh = {p: np.asarray(nm(w)) for p, w in kernels(state).items()}
  rng = np.random.default_rng(1)
  refreshes = 0
  for step in range(1, 9):
    state, metrics = train.train_step(state, random_batch(rng), model=model, tx=tx)
    plain = {p: np.asarray(nm(w)) for p, w in kernels(state).items()}
    drift = (sum(int((plain[p] != at_refresh[p]).sum()) for p in paths)
             / sum(m.size for m in plain.values()))
    np.testing.assert_allclose(float(metrics["mask_refresh/drift"]), drift, rtol=1e-6)
    refreshed = drift > tau
    assert float(metrics["mask_refresh/refreshed"]) == float(refreshed), step
    if refreshed:
      refreshes += 1
      at_refresh = plain
      for p in paths:
        np.testing.assert_array_equal(np.asarray(state_lib.get_path(state.sparsity, p)["mask"]),
                                      np.asarray(tmask(kernels(state)[p])))
  assert 0 < refreshes < 8   # it refreshed when the weights moved, not every step


def _transposable_rate(before, after, paths):
  """NumPy: the fraction of entries whose transposable mask changed between two weights."""
  tmask = jax.jit(masks.transposable_mask)
  changed = sum(int((np.asarray(tmask(after[p])) != np.asarray(tmask(before[p]))).sum())
                for p in paths)
  return changed / sum(after[p].size for p in paths)


@pytest.mark.parametrize("controlled", [False, True])
def test_flip_rate_transposable_is_measured_exactly_at_the_logged_steps(controlled):
  """The loop's StepInfo says which steps it logs (log_every = 3 of 8: steps done 3, 6, 8);
  flip_rate_transposable is measured at those steps (a NumPy count of transposable-mask
  changes of the step's W) and NaN at the others, the method holding no copy of log_every.
  With the lambda_W controller it is also measured in the controller window [2, 4), logged
  or not. `flip_rate`, the plain mask's, is measured at every step either way."""
  total, log_every = 8, 3
  overrides = {"optim.lr": 3e-2, "sparsity.t_sr_ste.mask_refresh_every": 2}
  if controlled:
    overrides.update({"sparsity.t_sr_ste.decay_auto": True,
                      "sparsity.t_sr_ste.decay_auto_steps": 4,
                      "sparsity.t_sr_ste.decay_auto_every": 1})
  config = _tiny("t_sr_ste", overrides, steps=total)
  config.log_every = log_every
  model, tx, state = fresh_model_state(config)
  method = model.config.sparsity.method
  assert not hasattr(method, "log_every") and not hasattr(method, "total_steps")
  paths = state_lib.sparse_layer_paths(state.sparsity)
  kernels = lambda s: {p: np.asarray(state_lib.get_path(s.params, p)["kernel"]) for p in paths}
  nm = jax.jit(masks.nm_mask)
  logged = [s for s in range(total) if itstime(s + 1, log_every, total)]
  assert logged == [2, 5, 7]                        # step indices; steps done 3, 6, 8
  window = set(range(2, 4)) if controlled else set()
  rng = np.random.default_rng(3)
  measured = []
  for step in range(total):
    info = StepInfo.at(step, log_every=log_every, total=total)
    assert info.log == (step in logged)
    before = kernels(state)
    state, metrics = train.train_step(state, random_batch(rng), info, model=model, tx=tx)
    after = kernels(state)
    rate = float(metrics["flip_rate_transposable"])
    per_layer = [float(metrics[f"flip_rate_transposable/{state_lib.layer_name(p)}"])
                 for p in paths]
    if step in logged or step in window:
      measured.append(step)
      np.testing.assert_allclose(rate, _transposable_rate(before, after, paths), rtol=1e-6,
                                 err_msg=f"step {step}")
      for p, r in zip(paths, per_layer):
        np.testing.assert_allclose(r, _transposable_rate(before, after, [p]), rtol=1e-6)
    else:
      assert np.isnan(rate) and all(np.isnan(r) for r in per_layer), step
    plain = sum(int((np.asarray(nm(after[p])) != np.asarray(nm(before[p]))).sum())
                for p in paths) / sum(after[p].size for p in paths)
    np.testing.assert_allclose(float(metrics["flip_rate"]), plain, rtol=1e-6)
  assert measured == ([2, 3, 5, 7] if controlled else [2, 5, 7])


@pytest.mark.slow
def test_a_t_sr_ste_run_logs_both_flip_rates_and_the_freeze(tmp_path, data_cache):
  config = tiny_config("t_sr_ste", steps=8, workdir_cache=data_cache, overrides={
      "sparsity.t_sr_ste.decay_auto": True, "sparsity.t_sr_ste.decay_auto_steps": 6,
      "sparsity.t_sr_ste.decay_auto_every": 1})
  config.log_every = 4   # steps 1-3 outside the window and off the log: not measured
  loop.train_and_evaluate(config, str(tmp_path))
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  logs = {r["step"]: r for r in records if "train/loss" in r}
  assert set(logs) == {4, 8}
  for r in logs.values():
    assert 0 <= r["train/flip_rate"] <= 1 and 0 <= r["train/flip_rate_transposable"] <= 1
    assert "train/flip_rate_transposable/h_0/mlp/fc" in r
  freeze = next(r for r in records if "method/decay_chosen" in r)
  assert freeze["step"] == 6 and freeze["method/decay_rounds"] == 3
  assert freeze["method/decay_stopped_unresponsive"] in (0.0, 1.0)
