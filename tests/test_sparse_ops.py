"""Tests for the Hu et al. 2024 recipe: the three-GEMM sparse op (MVUE on and off), the
cached transposable-mask projection t_sr_ste, masked decay on the cached mask, the flip-rate
warning and gated FFNs (the lambda_W warm-up controller: tests/test_decay_controller.py).

References are plain jnp / NumPy written from the formulas (y = x (m W)^T, dX = dY (m W),
dW = dY^T x), or plain-Python re-statements of a documented procedure, not calls back into
the code under test.
"""
from __future__ import annotations

import dataclasses

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
