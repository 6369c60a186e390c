"""Tests for the Hu et al. 2024 recipe: the three-GEMM sparse op (MVUE on and off), the
cached transposable-mask projection t_sr_ste, masked decay on the cached mask, the lambda_W
warm-up controller, the flip-rate warning and gated FFNs.

References are plain jnp / NumPy written from the formulas (y = x (m W)^T, dX = dY (m W),
dW = dY^T x), or plain-Python re-statements of a documented procedure, not calls back into
the code under test.
"""
from __future__ import annotations

import dataclasses
import types

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax import flip_monitor
from s24jax import losses
from s24jax import loop
from s24jax.kernels import masks
from s24jax import model as model_lib
from s24jax import sparse_ops
from s24jax import state as state_lib
from s24jax import train
from s24jax.methods import sr_ste
from s24jax.model import GPT2
from s24jax.sparse_linear import SparseLinear, SparsityConfig
from s24jax.methods import base
from s24jax.methods import registry

from tiny import tiny_config

HI = jax.lax.Precision.HIGHEST


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _mm(a, b):
  return jnp.matmul(a, b, precision=HI)


# ---------------------------------------------------------------------------------------------
# The three-GEMM op.


def test_sparse_linear_layer_gradients_equal_dense_masked_reference():
  """Through SparseLinear (the dispatch point) with t_sr_ste, MVUE off: all three GEMMs."""
  cfg = SparsityConfig(method=registry.get_method("t_sr_ste"), sparse_layers=("*",))
  layer = SparseLinear(8, cfg, name="fc")
  x = _normal(0, (2, 4, 12))                                     # (B, T, in)
  variables = flax.core.unfreeze(layer.init(jax.random.PRNGKey(1), x))
  w = variables["params"]["kernel"]                              # (out=8, in=12)
  variables["params"]["bias"] = _normal(7, (8,))
  m = masks.transposable_mask(w)
  np.testing.assert_array_equal(variables["sparsity"]["mask"], m)
  dy = _normal(2, (2, 4, 8))                                     # (B, T, out)

  def f(params, x):
    return layer.apply({"params": params, "sparsity": variables["sparsity"]}, x)

  y, vjp = jax.vjp(f, variables["params"], x)
  dparams, dx = vjp(dy)

  wt = jnp.where(m, w, 0.0)                                      # m (.) W, 2:4 both ways
  x2, dy2 = x.reshape(8, 12), dy.reshape(8, 8)
  np.testing.assert_allclose(y, (_mm(x2, wt.T) + variables["params"]["bias"]).reshape(2, 4, 8),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, _mm(dy2, wt).reshape(2, 4, 12), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dparams["kernel"], _mm(dy2.T, x2), rtol=1e-5, atol=1e-5)  # STE
  np.testing.assert_allclose(dparams["bias"], dy2.sum(0), rtol=1e-5, atol=1e-5)       # dense


def test_op_matches_reference_for_unstructured_weight_and_leading_dims():
  """The op itself does not assume a mask: any W~, any leading dims of x."""
  x, w, dy = _normal(3, (3, 2, 8)), _normal(4, (4, 8)), _normal(5, (3, 2, 4))
  y, vjp = jax.vjp(lambda x, w: sparse_ops.sparse_linear(x, w), x, w)
  dx, dw = vjp(dy)
  np.testing.assert_allclose(y, jnp.einsum("bti,oi->bto", x, w, precision=HI), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(dx, jnp.einsum("bto,oi->bti", dy, w, precision=HI), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(dw, jnp.einsum("bto,bti->oi", dy, x, precision=HI), rtol=1e-5,
                             atol=1e-5)


def _grads_with_mvue(x, w, dy, key):
  _, vjp = jax.vjp(lambda x, w: sparse_ops.sparse_linear(x, w, key, mvue=True), x, w)
  return vjp(dy)


def test_mvue_estimate_of_dy_transposed_is_24_along_tokens():
  """With x = I (tokens = in), dW = est(dY^T) x is the estimate itself: 2:4 along tokens."""
  n, out = 16, 8
  dy = _normal(6, (n, out))                                      # (N, out)
  _, dw = _grads_with_mvue(jnp.eye(n), _normal(7, (out, n)), dy, jax.random.PRNGKey(0))
  groups = np.asarray(dw).reshape(out, n // 4, 4)                # (out, N/4, 4) along tokens
  nnz = (groups != 0).sum(-1)
  assert nnz.max() <= 2 and (nnz == 2).all()                     # dy has no zeros
  # The kept entries are rescaled dY^T entries: x_i / p_i with p_i <= 1, same sign.
  kept = dw != 0
  ratio = np.asarray(dw)[kept] / np.asarray(dy.T)[kept]
  assert (ratio >= 1 - 1e-6).all()


def test_mvue_weight_gradient_is_unbiased_and_data_gradient_exact():
  n, d_in, out, draws = 8, 4, 4, 4000
  x, w, dy = _normal(8, (n, d_in)), _normal(9, (out, d_in)), _normal(10, (n, out))
  keys = jax.random.split(jax.random.PRNGKey(3), draws)
  dxs, dws = jax.jit(jax.vmap(lambda k: _grads_with_mvue(x, w, dy, k)))(keys)
  ref = np.asarray(_mm(dy.T, x), np.float64)                     # (out, in)
  samples = np.asarray(dws, np.float64)
  mean, std = samples.mean(0), samples.std(0)
  assert (std > 1e-3).all()                                      # genuinely stochastic
  z = np.abs(mean - ref) / (std / np.sqrt(draws))
  assert z.max() < 5.0, z.max()
  for dx in np.asarray(dxs)[:3]:                                 # dX does not use MVUE
    np.testing.assert_allclose(dx, _mm(dy, w), rtol=1e-5, atol=1e-5)


def test_mvue_errors_name_the_problem():
  x, w = _normal(0, (6, 4)), _normal(1, (4, 4))
  with pytest.raises(ValueError, match="rngs=\\{'sparsity'"):
    jax.grad(lambda w: sparse_ops.sparse_linear(x[:4], w, None, mvue=True).sum())(w)
  with pytest.raises(ValueError, match="multiple of 4"):      # 6 tokens
    jax.grad(lambda w: sparse_ops.sparse_linear(x, w, jax.random.PRNGKey(0),
                                                mvue=True).sum())(w)
  with pytest.raises(ValueError, match="valid: xla"):
    sparse_ops.sparse_linear(x, w, backend="cusparse")


# ---------------------------------------------------------------------------------------------
# t_sr_ste in training: cached transposable mask, refresh cadence, MVUE keys, masked decay.


def _tiny(projection, **overrides):
  c = tiny_config(projection, **overrides)
  c.model.vocab_size = 64
  return c


def _fresh(config):
  _, model_cfg, tx_fn = loop.build(config)
  model = GPT2(model_cfg)
  state = train.fresh_state(model, tx_fn, config.seed)
  return model, tx_fn(state.params, state.sparsity), state


def _batch(rng):
  tokens = rng.integers(0, 64, size=(4, 17))
  return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def test_t_sr_ste_mask_refreshed_exactly_every_k_steps_and_cached_between():
  k = 3
  config = _tiny("t_sr_ste", sparsity__t_sr_ste__mask_refresh_every=k, sparsity__mvue=True,
                 sparsity__t_sr_ste__decay=1e-3, optim__lr=3e-2)
  model, tx, state = _fresh(config)
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
    state, metrics = train.train_step(state, _batch(rng), model=model, tx=tx)
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
  config = _tiny("t_sr_ste", sparsity__t_sr_ste__mask_refresh_every=1000,
                 sparsity__t_sr_ste__mask_refresh_drift=tau, optim__lr=3e-2)
  model, tx, state = _fresh(config)
  paths = state_lib.sparse_layer_paths(state.sparsity)
  kernels = lambda s: {p: np.asarray(state_lib.get_path(s.params, p)["kernel"]) for p in paths}
  nm = jax.jit(masks.nm_mask)
  tmask = jax.jit(masks.transposable_mask)
  at_refresh = {p: np.asarray(nm(w)) for p, w in kernels(state).items()}
  rng = np.random.default_rng(1)
  refreshes = 0
  for step in range(1, 9):
    state, metrics = train.train_step(state, _batch(rng), model=model, tx=tx)
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


def test_mvue_keys_differ_per_step_and_repeat_within_a_step():
  """Same weights, two steps' rng -> different weight gradients; identical steps agree."""
  config = _tiny("t_sr_ste", sparsity__mvue=True)
  model, _, state = _fresh(config)
  batch = _batch(np.random.default_rng(1))

  @jax.jit
  def grads(step):
    rng = jax.random.fold_in(jax.random.fold_in(state.rng, step), train._SPARSITY_STREAM)
    def loss(params):
      logits = model.apply({"params": params, "sparsity": state.sparsity}, batch["inputs"],
                           rngs={"sparsity": rng})
      return losses.cross_entropy_sum(logits, batch["targets"])
    return jax.grad(loss)(state.params)["h_0"]["mlp"]

  g0, g0_again, g1 = grads(0), grads(0), grads(1)
  np.testing.assert_array_equal(g0["fc"]["kernel"], g0_again["fc"]["kernel"])
  assert (g0["fc"]["kernel"] != g1["fc"]["kernel"]).any()
  np.testing.assert_array_equal(g0["fc"]["bias"], g1["fc"]["bias"])   # bias grad: dense, exact


# ---------------------------------------------------------------------------------------------
# The lambda_W warm-up controller.


def _controller_reference(rs, steps, cfg):
  """Plain-Python statement of the controller's documented procedure (docs/algorithms.md,
  "Choosing lambda_W in warm-up")."""
  lam, ema, count, out = cfg.decay_auto_init, 0.0, 0, []
  hi, lo = cfg.decay_auto_target * cfg.decay_auto_band, cfg.decay_auto_target / cfg.decay_auto_band
  for step, r in zip(steps, rs):
    if cfg.decay_auto_steps // 2 <= step < cfg.decay_auto_steps and not np.isnan(r):
      ema = r if count == 0 else sr_ste.CONTROL_EMA * ema + (1 - sr_ste.CONTROL_EMA) * r
      count += 1
      if ema > hi:
        lam = min(lam * cfg.decay_auto_rate, sr_ste.MAX_DECAY)
      elif ema < lo:
        lam = max(lam / cfg.decay_auto_rate, sr_ste.MIN_DECAY)
    out.append(lam)
  return out


def _controller_start(method):
  """The method state a fresh run starts with (init_state on empty params)."""
  return method.init_state({}, {}, jax.random.key(0))[2]


def test_decay_controller_on_synthetic_flip_rates():
  cfg = dataclasses.replace(registry.get_method("sr_ste"), decay_auto=True, decay_auto_init=1e-4,
                            decay_auto_target=1e-2, decay_auto_band=2.0, decay_auto_rate=1.5,
                            decay_auto_steps=76)          # adapts during steps [38, 76)
  # ignored (first half), explode (10x target), collapse to 0, no measurements, in band, frozen
  rs = [1.0] * 3 + [0.1] * 6 + [0.0] * 20 + [np.nan] * 3 + [0.01] * 9 + [1.0] * 5
  steps = list(range(35, 35 + len(rs)))
  ctrl, got = _controller_start(cfg), []
  update = jax.jit(cfg.control)
  for step, r in zip(steps, rs):
    ctrl = update(ctrl, jnp.float32(r), jnp.int32(step))
    got.append(float(ctrl.decay))
  np.testing.assert_allclose(got, _controller_reference(rs, steps, cfg), rtol=1e-5)
  # The behaviour in words (band [5e-3, 2e-2], EMA 0.8), o = offset of the first active step:
  o = 3
  assert got[:o] == [pytest.approx(1e-4)] * o                  # first half: listens to nothing
  assert got[o + 5] == pytest.approx(1e-4 * 1.5 ** 6, rel=1e-5)  # up x1.5 per exploding step
  assert got[o + 12] == max(got)                               # the EMA lags: up until +12
  assert len(set(got[o + 12:o + 19])) == 1                     # EMA inside the band: hold
  assert got[o + 19] < got[o + 18] and got[o + 25] < got[o + 19]  # mask freezing: down
  assert got[o + 26] == got[o + 27] == got[o + 28] == got[o + 25]  # no measurement
  assert len(set(got[o + 31:o + 38])) == 1                     # back in the band: hold
  assert set(got[o + 38:]) == {got[o + 37]}                    # frozen, even when exploding
  assert int(ctrl.count) == 6 + 20 + 9


def test_controller_warns_when_the_flip_rate_never_reaches_the_band(monkeypatch):
  """At the freeze the hook says so (warning + sparsity/decay_band_reached = 0) when lambda_W
  rose at every controller step, and stays quiet when it ever held or fell."""
  cfg = dataclasses.replace(registry.get_method("t_sr_ste"), name="t_sr_ste", decay_auto=True,
                            decay_auto_init=1e-4, decay_auto_target=1e-2, decay_auto_rate=1.5,
                            decay_auto_steps=20)   # adapts during steps [10, 20)
  update = jax.jit(cfg.control)

  def freeze(rates):
    ctrl = _controller_start(cfg)
    for step, r in enumerate(rates):
      ctrl = update(ctrl, jnp.float32(r), jnp.int32(step))
    warnings, written = [], {}
    monkeypatch.setattr(sr_ste.logging, "warning", lambda *a: warnings.append(a))
    ctx = types.SimpleNamespace(state=types.SimpleNamespace(method_state=ctrl),
                                step=20, write=lambda step, m: written.update(m))
    cfg._log_chosen_decay(ctx)   # pylint: disable=protected-access
    return ctrl, warnings, written

  ctrl, warnings, written = freeze([0.5] * 20)          # 50x the target throughout: up, up, ...
  assert float(ctrl.decay) == pytest.approx(1e-4 * 1.5 ** 10, rel=1e-5)
  assert len(warnings) == 1 and written["sparsity/decay_band_reached"] == 0.0
  assert written["sparsity/decay_chosen"] == pytest.approx(1e-4 * 1.5 ** 10, rel=1e-5)
  # Steps whose smoothed rate is inside the band hold lambda_W: the band counts as reached.
  ctrl, warnings, written = freeze([0.5] * 10 + [0.01] * 9 + [0.5])
  assert float(ctrl.decay) < 1e-4 * 1.5 ** 9
  assert not warnings and written["sparsity/decay_band_reached"] == 1.0
  # Capped at MAX_DECAY: stuck too, whatever the count.
  capped = sr_ste.ControllerState(decay=jnp.float32(sr_ste.MAX_DECAY), count=jnp.int32(500),
                                  flip_ema=jnp.float32(0.5))
  assert cfg.never_in_band(capped)
  assert not cfg.never_in_band(_controller_start(cfg))   # never acted: nothing to say


def test_decay_controller_wired_into_training_and_frozen_after_warmup():
  """sr_ste with lambda auto: a target far below the tiny model's flip rate makes lambda
  grow by exactly `rate` per step in the second half of warm-up, then it stays put."""
  config = _tiny("sr_ste", sparsity__sr_ste__decay=0.0, sparsity__sr_ste__decay_auto=True,
                 sparsity__sr_ste__decay_auto_target=1e-7, sparsity__sr_ste__decay_auto_rate=2.0,
                 sparsity__sr_ste__decay_auto_init=1e-3, optim__warmup_steps=6)
  assert registry.from_config(config).decay_auto_steps == 6   # 0 -> the warm-up
  model, tx, state = _fresh(config)
  rng, lams = np.random.default_rng(2), []
  for _ in range(8):
    state, metrics = train.train_step(state, _batch(rng), model=model, tx=tx)
    # the lambda this step used is the controller's value before the step
    assert float(metrics["sparsity/decay"]) == pytest.approx(lams[-1] if lams else 1e-3)
    lams.append(float(state.method_state.decay))   # the controller's state
  np.testing.assert_allclose(lams, [1e-3] * 3 + [2e-3, 4e-3, 8e-3, 8e-3, 8e-3], rtol=1e-6)


def test_fixed_decay_overrides_auto():
  cfg = dataclasses.replace(registry.get_method("sr_ste"), decay=6e-5, decay_auto=True)
  assert not cfg.controlled and _controller_start(cfg) == {}
  assert cfg.current_decay({}) == np.float32(6e-5)
  assert dataclasses.replace(registry.get_method("t_sr_ste"), decay_auto=True).controlled
  # ste takes no masked decay: decay_auto in a config whose method is ste gives no controller.
  ste = registry.from_config(_tiny("ste", sparsity__sr_ste__decay_auto=True))
  assert ste.name == "ste" and _controller_start(ste) == {}
  assert not getattr(ste, "controlled", False)
  assert not isinstance(ste, base.OptimizerTransforms)   # no transforms in its optimizer
  with pytest.raises(ValueError, match="placement"):
    dataclasses.replace(registry.get_method("sr_ste"), decay_auto=True,
                        decay_placement="backward")


# ---------------------------------------------------------------------------------------------
# Flip-rate warning.


def test_flip_rate_warning_fires_after_patience_not_before(monkeypatch):
  warnings = []
  monkeypatch.setattr(flip_monitor.logging, "warning", lambda *a: warnings.append(a))
  mon = flip_monitor.FlipRateMonitor(threshold=0.1, patience=3)
  seq = [0.2, 0.2, 0.05, 0.2, 0.2, None, float("nan"), 0.2, 0.2, 0.2, 0.2, 0.2, 0.01]
  flags = [mon.update(i, r) for i, r in enumerate(seq)]
  # streak: 1 2 0 1 2 (2) (2) 3 4 5 6 7 0 -> fires from the 3rd consecutive high log on.
  assert flags == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0]
  assert [w[1] for w in warnings] == [7, 10]            # at streak 3 and again at 6
  off = flip_monitor.FlipRateMonitor(threshold=0.0, patience=1)
  assert [off.update(i, 1.0) for i in range(3)] == [0, 0, 0]


# ---------------------------------------------------------------------------------------------
# Gated FFNs: all three FFN matrices sparse.


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_gated_ffn_has_all_matrices_24_sparse(activation):
  c = _tiny("t_sr_ste", model__activation=activation)
  model = GPT2(model_lib.model_config(c))
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))
  C, H = c.model.d_model, int(c.model.mlp_ratio * c.model.d_model)
  fc = variables["params"]["h_0"]["mlp"]["fc"]["kernel"]
  assert fc.shape == (2 * H, C)     # [value | gate] rows: one (2H, C) kernel, 2:4 along C
  wts = {}
  for name, shape in (("fc", (2 * H, C)), ("proj", (C, H))):
    kernel = variables["params"]["h_0"]["mlp"][name]["kernel"]
    m = np.asarray(variables["sparsity"]["h_0"]["mlp"][name]["mask"])
    assert m.shape == shape
    assert model.config.sparsity.method.name == "t_sr_ste"
    wts[name] = np.asarray(model.config.sparsity.method.project(
        kernel, variables["sparsity"]["h_0"]["mlp"][name]))
  # The three FFN matrices: value (fc rows :H), gate (fc rows H:), proj; each 2:4 along its
  # contraction axis `in` and (transposable) along `out`.
  for wt in (wts["fc"][:H], wts["fc"][H:], wts["proj"]):
    nz = wt != 0
    assert (nz.reshape(wt.shape[0], -1, 4).sum(-1) == 2).all()
    assert (nz.T.reshape(wt.shape[1], -1, 4).sum(-1) == 2).all()
