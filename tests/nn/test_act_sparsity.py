"""Tests for s24jax/nn/act_sparsity.py, V:N:M activation sparsity (Haziza et al.): the op, its
gradient rule, the model wiring, the measurement, its chore (`stats_chores`) and the loop's
logging. References are plain jnp/NumPy written here (the FFN written out, hand-derived
gradients, statistics computed by hand or from activations captured by interception); the
V:N:M mask itself (`masks.venom_mask`) is checked against brute force in the tests of
kernels/masks.py.
"""
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.nn import act_sparsity
from s24jax.training import diagnostics
from s24jax.training import loop
from s24jax.kernels import masks
from s24jax.nn import model as model_lib
from s24jax.nn.act_sparsity import ActSparsityConfig
from s24jax.nn.model import GPT2
from s24jax.nn.model import MLP
from s24jax.nn.model import ModelConfig
from s24jax.nn.sparse_linear import SparsityConfig
from s24jax.methods import registry
from s24jax.step_info import StepInfo

from tiny import tiny_config

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")

V, N, M = 8, 2, 8


def _relu2_acts(key, shape):
  """Squared-ReLU-like activations: about half exact zeros, heavy-tailed positives."""
  return jnp.square(jax.nn.relu(jax.random.normal(key, shape)))


# ----------------------------------------------------------------------------------------
# The op: forward, padding, gradient rule
# ----------------------------------------------------------------------------------------


def test_sparsify_forward_is_the_venom_masked_activation():
  h = _relu2_acts(jax.random.key(0), (2, 16, 32))                     # (B, T, H)
  out, mask, col_idx = jax.jit(act_sparsity.sparsify, static_argnums=(1, 2, 3))(h, V, N, M)
  want_mask = masks.venom_mask(h.reshape(32, 32), V, N, M).reshape(h.shape)
  np.testing.assert_array_equal(mask, want_mask)
  np.testing.assert_array_equal(out, np.where(want_mask, h, 0.0))
  assert out.dtype == h.dtype and col_idx.shape == (32 // V, 32 // M, 4)
  # density N/M in every row of every block of M columns
  np.testing.assert_array_equal(np.asarray(mask).reshape(32, 4, M).sum(-1), N)


def test_token_count_not_multiple_of_v_is_padded_like_a_short_last_block():
  h = _relu2_acts(jax.random.key(1), (3, 10, 16))                     # 30 rows, V = 8
  mask = np.asarray(act_sparsity.sparsify(h, V, N, M)[1]).reshape(30, 16)
  rows = np.asarray(h).reshape(30, 16)
  for start in range(0, 30, V):
    block = rows[start:start + V]                                     # last block: 6 rows
    want = masks.venom_mask(jnp.asarray(block), block.shape[0], N, M)
    np.testing.assert_array_equal(mask[start:start + V], want, err_msg=f"block {start}")


def test_gradient_is_upstream_gradient_on_the_kept_entries():
  h = jax.random.normal(jax.random.key(2), (4, 8, 16))                # signed: abs matters
  upstream = jax.random.normal(jax.random.key(3), h.shape)
  mask = masks.venom_mask(h.reshape(32, 16), V, N, M).reshape(h.shape)
  grad = jax.grad(lambda h: jnp.sum(upstream * act_sparsity.sparsify(h, V, N, M)[0]))(h)
  np.testing.assert_array_equal(grad, np.where(mask, upstream, 0.0))


def test_gradient_through_the_second_matmul():
  """d/dh and d/dW of (sparsify(h) W^T) against hand-derived dense formulas."""
  h = _relu2_acts(jax.random.key(4), (16, 16))                        # (R, H)
  w = jax.random.normal(jax.random.key(5), (6, 16))                   # (out, H)
  dy = jax.random.normal(jax.random.key(6), (16, 6))                  # (R, out)
  mask = np.asarray(masks.venom_mask(h, V, N, M))

  def f(h, w):
    return jnp.sum(dy * (act_sparsity.sparsify(h, V, N, M)[0] @ w.T))

  gh, gw = jax.grad(f, argnums=(0, 1))(h, w)
  hs = np.where(mask, np.asarray(h), 0.0)
  np.testing.assert_allclose(gh, mask * (np.asarray(dy) @ np.asarray(w)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gw, np.asarray(dy).T @ hs, rtol=1e-5, atol=1e-5)


def test_bad_hidden_dimension_and_config_errors_name_the_field():
  with pytest.raises(ValueError, match="hidden dimension H"):
    act_sparsity.sparsify(jnp.ones((8, 12)), V, N, M)
  with pytest.raises(ValueError, match="act_sparsity.kind 'vnm'.*none, venom"):
    ActSparsityConfig(kind="vnm")
  with pytest.raises(ValueError, match="0 <= n <= 4.*n=5"):
    ActSparsityConfig(kind="venom", n=5)
  with pytest.raises(ValueError, match="model.mlp_ratio \\* model.d_model = 36.*act_sparsity.m=8"):
    ModelConfig(d_model=12, mlp_ratio=3, num_heads=2, act=ActSparsityConfig(kind="venom"))
  with pytest.raises(ValueError, match="act_sparsity.backend 'nope'.*xla, pallas"):
    act_sparsity.sparsify(jnp.ones((8, 16)), V, N, M, backend="nope")


# ----------------------------------------------------------------------------------------
# The model wiring
# ----------------------------------------------------------------------------------------


def _mlp(projection="dense", act="none", mlp_ratio=4.0, **act_fields):
  act_fields = {"v": V, **act_fields}
  # float32 compute (the default 'auto' is bfloat16 on a GPU): the references are float32.
  cfg = ModelConfig(vocab_size=64, seq_len=16, num_layers=1, num_heads=2, d_model=16,
                    mlp_ratio=mlp_ratio, activation="relu2", dtype="float32",
                    sparsity=SparsityConfig(method=registry.get_method(projection),
                                            sparse_layers=("fc", "proj")),
                    act=ActSparsityConfig(kind=act, **act_fields))
  return MLP(cfg)


def _mlp_reference(variables, x, *, act_mask: bool, projected: bool):
  """Plain jnp FFN: relu(x W1~^T + b1)^2 [masked V:N:M] W2~^T + b2."""
  p = variables["params"]

  def weight(name):
    w = p[name]["kernel"]
    if projected:   # S-STE forward: beta * S(W) with the stored scale
      return variables["sparsity"][name]["scale"] * masks.soft_threshold24(w)
    return w

  h = jnp.square(jax.nn.relu(x @ weight("fc").T + p["fc"]["bias"]))           # (B, T, H)
  if act_mask:
    h = jnp.where(masks.venom_mask(h.reshape(-1, h.shape[-1]), V, N, M).reshape(h.shape), h, 0)
  return h @ weight("proj").T + p["proj"]["bias"]                             # (B, T, C)


@pytest.mark.parametrize("projection,act", [("dense", "none"), ("dense", "venom"),
                                            ("s_ste", "venom")])
def test_mlp_equals_plain_reference(projection, act):
  x = jax.random.normal(jax.random.key(7), (2, 8, 16))                        # 16 tokens
  mlp = _mlp(projection, act)
  variables = mlp.init(jax.random.key(8), x)
  want = _mlp_reference(variables, x, act_mask=act == "venom",
                        projected=projection != "dense")
  np.testing.assert_allclose(mlp.apply(variables, x), want, rtol=1e-5, atol=1e-5)


def _gpt(overrides=None):
  c = tiny_config("dense", overrides={"model.activation": "relu2", "act_sparsity.v": V,
                                      **(overrides or {})})
  return GPT2(model_lib.model_config(c)), c


def test_keep_all_venom_model_equals_the_model_without_act_sparsity():
  """The wiring through GPT2: a 4:4 mask (keeps everything) changes nothing, 2:8 does.
  (That 'none' is the plain relu2 FFN is checked against jnp in test_mlp_equals_plain_...)"""
  tokens = jax.random.randint(jax.random.key(9), (2, 16), 0, 50257)
  none, _ = _gpt()      # the relu2 model as it was before act sparsity existed
  keep_all, _ = _gpt({"act_sparsity.kind": "venom", "act_sparsity.n": 4, "act_sparsity.m": 4})
  venom, _ = _gpt({"act_sparsity.kind": "venom"})
  params = none.init(jax.random.key(0), tokens)["params"]
  ref = none.apply({"params": params}, tokens)
  np.testing.assert_allclose(keep_all.apply({"params": params}, tokens), ref, rtol=1e-6,
                             atol=1e-6)
  assert not np.allclose(venom.apply({"params": params}, tokens), ref, atol=1e-3)


def test_dense_twin_switches_off_weight_and_activation_sparsity():
  c = tiny_config("s_ste", overrides={"model.activation": "relu2",
                                      "act_sparsity.kind": "venom"})
  cfg = model_lib.model_config(c)
  twin = cfg.dense_twin()
  assert (twin.sparsity.method.name, twin.act.kind) == ("dense", "none")
  assert (cfg.sparsity.method.name, cfg.act.kind) == ("s_ste", "venom")


def test_registered_act_backend_selects_and_multiplies():
  calls = []

  def select(h2, v, n, m):
    calls.append(("select", h2.shape))
    return masks.venom_select(h2, v, n, m)

  def matmul(h_sparse, col_idx, w):
    calls.append(("matmul", h_sparse.shape, col_idx.shape, w.shape))
    return h_sparse @ w.T

  act_sparsity.register_act_backend("test_fake", act_sparsity.ActBackend(select, matmul))
  try:
    x = jax.random.normal(jax.random.key(10), (2, 5, 16))             # 10 tokens: padded
    ref_mlp, fake_mlp = _mlp(act="venom"), _mlp(act="venom", backend="test_fake")
    variables = ref_mlp.init(jax.random.key(11), x)
    np.testing.assert_allclose(fake_mlp.apply(variables, x), ref_mlp.apply(variables, x),
                               rtol=1e-6, atol=1e-6)
    assert calls == [("select", (16, 64)), ("matmul", (16, 64), (2, 64 // M, 4), (16, 64))]
  finally:
    act_sparsity._ACT_BACKENDS.pop("test_fake")   # pylint: disable=protected-access


def _venom_kernels_available():
  try:
    import s24jax.kernels.venom  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    return True
  except ImportError:
    return False


@pytest.mark.skipif(not _venom_kernels_available(), reason="kernels/venom.py not importable")
def test_pallas_backend_matches_the_xla_reference():
  """kernels/venom.py (Pallas interpret mode on CPU) vs the jnp reference: mask, forward
  of the MLP and its gradients. Signed normal data, so no ties decide anything."""
  v = 16
  x = jax.random.normal(jax.random.key(12), (1, 16, 16))                     # 16 tokens
  h = jax.random.normal(jax.random.key(13), (1, 16, 128))   # the MLP's shape: one compile
  _, mask_x, _ = act_sparsity.sparsify(h, v, 2, M)
  _, mask_p, _ = act_sparsity.sparsify(h, v, 2, M, backend="pallas")
  np.testing.assert_array_equal(mask_p, mask_x)

  mlps = {b: _mlp("s_ste", "venom", mlp_ratio=8.0, backend=b, v=v)
          for b in ("xla", "pallas")}
  variables = mlps["xla"].init(jax.random.key(14), x)

  def loss(params, b):
    y = mlps[b].apply({**variables, "params": params}, x)
    return jnp.sum(y * jnp.cos(y)), y

  (_, y_x), g_x = jax.value_and_grad(loss, has_aux=True)(variables["params"], "xla")
  (_, y_p), g_p = jax.value_and_grad(loss, has_aux=True)(variables["params"], "pallas")
  np.testing.assert_allclose(y_p, y_x, rtol=1e-4, atol=1e-4)
  for a, b in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_x)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------


def test_stats_hand_computed():
  # One block: v = 2 rows, m = 8 columns, 2:8. Row 0's mass is in columns 0 and 7 (plus a 1
  # in column 3), row 1's in columns 1 and 4. The only subset that keeps both rows' top two
  # is {0, 1, 4, 7}: kept 5 + 2 + 4 + 3 = 14 of 15. Zeros: 11 of 16.
  h = jnp.array([[-5.0, 0, 0, 1, 0, 0, 0, 2],
                 [0.0, 4, 0, 0, 3, 0, 0, 0]])
  stats = act_sparsity.activation_sparsity_stats(h, 2, 2, 8)
  np.testing.assert_allclose(stats["zero_frac"], 11 / 16)
  np.testing.assert_allclose(stats["kept_l1"], 14 / 15, rtol=1e-6)
  np.testing.assert_allclose(act_sparsity.kept_l1_fraction(h, h > 2), (4 + 3) / 15, rtol=1e-6)
  assert float(act_sparsity.kept_l1_fraction(jnp.zeros((2, 8)), jnp.zeros((2, 8), bool))) == 1.0
  np.testing.assert_allclose(act_sparsity.zero_fraction(jnp.array([0.0, -0.0, 1e-30, 2.0])), 0.5)


def test_activation_stats_per_layer_match_the_captured_activations():
  """activation_stats vs the stats of each layer's proj input, captured by interception."""
  model, _ = _gpt({"model.num_layers": 2})
  tokens = jax.random.randint(jax.random.key(12), (4, 16), 0, 50257)
  params = model.init(jax.random.key(0), tokens)["params"]
  captured = {}

  def grab(next_fun, args, kwargs, context):
    if context.module.name == "proj" and context.method_name == "__call__":
      captured[context.module.path[0]] = args[0]
    return next_fun(*args, **kwargs)

  import flax.linen as nn   # pylint: disable=g-import-not-at-top
  with nn.intercept_methods(grab):
    model.apply({"params": params}, tokens)
  got = diagnostics.activation_stats(params, {}, tokens, model=model, num_sequences=4)
  assert set(captured) == {"h_0", "h_1"}
  for layer, h in captured.items():
    rows = h.reshape(-1, h.shape[-1])                                          # (64, 128)
    np.testing.assert_allclose(got[f"act/zero_frac/{layer}"], np.mean(np.asarray(rows) == 0))
    a = np.abs(np.asarray(rows))
    kept = a[np.asarray(masks.venom_mask(rows, V, N, M))].sum() / a.sum()
    np.testing.assert_allclose(got[f"act/kept_l1/{layer}"], kept, rtol=1e-5)
  np.testing.assert_allclose(got["act/kept_l1"],
                             (got["act/kept_l1/h_0"] + got["act/kept_l1/h_1"]) / 2, rtol=1e-6)
  # the ordinary forward sows nothing (train and eval steps pay nothing)
  assert not isinstance(model.apply({"params": params}, tokens), tuple)


def _proj_inputs(model, params, tokens):
  """{layer: the input of its FFN's second matmul}, captured by interception (flax)."""
  captured = {}

  def grab(next_fun, args, kwargs, context):
    if context.module.name == "proj" and context.method_name == "__call__":
      captured[context.module.path[0]] = np.asarray(args[0])
    return next_fun(*args, **kwargs)

  import flax.linen as nn   # pylint: disable=g-import-not-at-top
  with nn.intercept_methods(grab):
    model.apply({"params": params}, tokens)
  return captured


@pytest.mark.parametrize("stats_sequences,rows_measured", [(2, 2), (8, 4)])
def test_stats_chore_measures_the_first_sequences_of_logged_steps(stats_sequences,
                                                                   rows_measured):
  """The loop's chore: before the train step (it sees the step's batch), only on logged
  steps, one forward on the first min(stats_sequences, batch_size) sequences, written at the
  step's next_step as Python floats. Reference: NumPy statistics of the activations of those
  sequences, captured by interception."""
  assert diagnostics.stats_chores(_gpt({"act_sparsity.stats_sequences": 0})[1]) == []
  model, c = _gpt({"act_sparsity.kind": "venom",
                   "act_sparsity.stats_sequences": stats_sequences})
  assert c.batch_size == 4
  [chore] = diagnostics.stats_chores(c)
  assert chore.before_step and not chore.training
  assert chore.is_due(StepInfo(step=2, log=True), total=10)
  assert not chore.is_due(StepInfo(step=3, log=False), total=10)
  assert chore.is_due(StepInfo.at(9, log_every=4, total=10), total=10)       # the last step
  assert not chore.is_due(StepInfo.at(8, log_every=4, total=10), total=10)

  tokens = jax.random.randint(jax.random.key(15), (4, 16), 0, 50257)
  params = model.init(jax.random.key(0), tokens)["params"]
  written = []
  run = types.SimpleNamespace(
      state=types.SimpleNamespace(params=params, sparsity={}), batch={"inputs": tokens},
      model=model, info=StepInfo(step=6, log=True),
      write=lambda step, scalars: written.append((step, dict(scalars))))
  chore.fn(run)
  [(step, got)] = written
  assert step == 7                                                    # info.next_step
  assert all(type(v) is float for v in got.values())   # pylint: disable=unidiomatic-typecheck
  # The activations before the V:N:M mask: the proj input of the same model without it.
  plain, _ = _gpt()
  rows = _proj_inputs(plain, params, tokens[:rows_measured])["h_0"].reshape(-1, 128)
  a = np.abs(rows)
  kept = a[np.asarray(masks.venom_mask(jnp.asarray(rows), V, N, M))].sum() / a.sum()
  np.testing.assert_allclose(got["act/zero_frac/h_0"], np.mean(rows == 0), rtol=1e-6)
  np.testing.assert_allclose(got["act/kept_l1/h_0"], kept, rtol=1e-5)
  assert got["act/kept_l1"] == got["act/kept_l1/h_0"]
  # Measuring all four sequences gives other numbers: the chore did take the first ones.
  all_rows = _proj_inputs(plain, params, tokens)["h_0"].reshape(-1, 128)
  if rows_measured < 4:
    assert got["act/zero_frac/h_0"] != pytest.approx(float(np.mean(all_rows == 0)), abs=1e-7)


# ----------------------------------------------------------------------------------------
# The loop: sparse-then-dense with activation statistics logged and plotted
# ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_loop_logs_activation_stats_through_sparse_and_dense_phases(tmp_path, data_cache):
  c = tiny_config("s_ste", steps=4, workdir_cache=data_cache, overrides={
      "model.activation": "relu2", "act_sparsity.kind": "venom", "act_sparsity.v": 16,
      "sparsity.dense_finetune_fraction": 0.5, "act_sparsity.stats_sequences": 2,
      "checkpoint_every": 4})
  workdir = str(tmp_path)
  final = loop.train_and_evaluate(c, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  # Each chore writes its own record; what one step logged is the union of its records.
  by_step = {}
  for r in records:
    by_step.setdefault(r["step"], {}).update(r)
  logged = [r for _, r in sorted(by_step.items()) if "train/loss" in r]
  assert [r["step"] for r in logged] == [1, 2, 3, 4]
  assert [r["train/dense_phase"] for r in logged] == [0.0, 0.0, 1.0, 1.0]
  for r in logged:
    assert 0 < r["act/zero_frac/h_0"] < 1 and 0 < r["act/kept_l1/h_0"] <= 1
    assert r["act/kept_l1"] == r["act/kept_l1/h_0"]
  assert np.isfinite(final["val/loss"]) and "act/zero_frac" in final
  assert os.path.exists(os.path.join(workdir, "metrics.png"))
