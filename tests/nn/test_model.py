"""Tests for s24jax/nn/model.py: GPT-2's shapes and per-layer collections, the sparse / dense
equivalence, the compute dtype ('auto'), the scanned blocks (nn.scan over stacked layers)
against the unrolled model, and clear errors for bad widths. References: the dense model
evaluated on weights projected here with NumPy (top-2 of every 4), the unrolled model with
the scanned model's stacked variables unstacked by hand, and the float32 model."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.training import config as config_lib
from s24jax.nn import model as model_lib
from s24jax.nn import sparse_linear
from s24jax import sparse_ops
from s24jax.nn.model import GPT2

import gpu_numerics
from tiny import tiny_config


def _model(projection="s_ste", overrides=None):
  return GPT2(model_lib.model_config(tiny_config(projection, overrides=overrides)))


def test_forward_shapes_and_sparsity_collection():
  model = _model("s_ste")
  tokens = jnp.zeros((2, 16), jnp.int32)
  variables = model.init(jax.random.key(0), tokens)
  logits = model.apply(variables, tokens)
  assert logits.shape == (2, 16, 50304) and logits.dtype == jnp.float32
  sp = variables["sparsity"]["h_0"]["mlp"]
  assert set(sp) == {"fc", "proj"}                        # only the FFN is sparse
  assert set(sp["fc"]) == {"scale", "mask"}
  w = variables["params"]["h_0"]["mlp"]["fc"]["kernel"]
  assert w.shape == (128, 32)                             # (out, in)
  assert sp["fc"]["mask"].shape == w.shape
  assert sparse_linear.PREPARED not in variables          # never initialised, never stored
  assert "sparsity" not in _model("dense").init(jax.random.key(0), tokens)


def test_sparse_model_with_dense_projection_equals_dense_model():
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 50257)
  dense = _model("dense", overrides={"sparsity.sparse_layers": ()})
  sparse_cfg = _model("dense")        # FFN layers selected as sparse, projection dense
  params = dense.init(jax.random.key(0), tokens)["params"]
  np.testing.assert_array_equal(dense.apply({"params": params}, tokens),
                                sparse_cfg.apply({"params": params}, tokens))


def test_sparse_forward_equals_dense_forward_on_projected_weights():
  """A STE model is the dense model evaluated at m(W)*W (an independent route)."""
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 50257)
  sparse = _model("ste")
  dense = _model("dense")
  variables = sparse.init(jax.random.key(0), tokens)
  params = jax.tree.map(lambda x: x, variables["params"])
  for name in ("fc", "proj"):
    k = np.asarray(params["h_0"]["mlp"][name]["kernel"]).reshape(-1, 4)
    order = np.argsort(-np.abs(k), axis=1, kind="stable")
    keep = np.zeros_like(k, bool)
    np.put_along_axis(keep, order[:, :2], True, axis=1)
    params["h_0"]["mlp"][name]["kernel"] = jnp.asarray(
        np.where(keep, k, 0).reshape(params["h_0"]["mlp"][name]["kernel"].shape))
  np.testing.assert_allclose(sparse.apply(variables, tokens),
                             dense.apply({"params": params}, tokens), rtol=1e-5, atol=1e-5)


def test_width_not_multiple_of_four_names_the_layer():
  model = _model("ste", overrides={"model.d_model": 30, "model.num_heads": 2})
  with pytest.raises(ValueError, match=r"h_0/mlp/fc.*30.*multiple of 4"):
    model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


def test_gated_ffn_makes_all_three_matrices_sparse():
  model = _model("ste", overrides={"model.activation": "swiglu"})
  v = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  assert v["params"]["h_0"]["mlp"]["fc"]["kernel"].shape == (2 * 128, 32)   # value | gate
  assert set(v["sparsity"]["h_0"]["mlp"]) == {"fc", "proj"}


def test_unknown_activation_lists_valid():
  with pytest.raises(ValueError, match="gelu.*relu2.*swiglu"):
    dataclasses.replace(model_lib.ModelConfig(), activation="tanh")


# ----------------------------------------------------------------------------------------
# The compute dtype
# ----------------------------------------------------------------------------------------


@pytest.mark.skipif(gpu_numerics.enabled(), reason="S24JAX_TEST_GPU_NUMERICS replaces the "
                    "platform rule this test checks ('auto' is bfloat16 there)")
def test_default_dtype_is_auto_and_float32_on_the_cpu():
  assert model_lib.ModelConfig().dtype == "auto"
  assert config_lib.base_config().model.dtype == "auto"      # the config block agrees
  want = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  assert model_lib.compute_dtype("auto") == want
  assert model_lib.compute_dtype("bfloat16") == jnp.bfloat16
  assert model_lib.compute_dtype("float32") == jnp.float32
  if jax.default_backend() != "cpu":
    return
  # On the CPU, 'auto' is exactly the float32 model (same parameters, same logits).
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 50257)
  auto = _model("s_ste", overrides={"model.dtype": "auto"})
  f32 = _model("s_ste", overrides={"model.dtype": "float32"})
  assert auto.config.dtype == "auto" and f32.config.dtype == "float32"
  variables = auto.init(jax.random.key(0), tokens)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(variables["params"]))
  np.testing.assert_array_equal(auto.apply(variables, tokens), f32.apply(variables, tokens))
  bf16 = _model("s_ste", overrides={"model.dtype": "bfloat16"}).apply(variables, tokens)
  assert not np.array_equal(bf16, auto.apply(variables, tokens))   # the dtype is honoured


# ----------------------------------------------------------------------------------------
# Scanned blocks (model.scan_layers)
# ----------------------------------------------------------------------------------------


# float32 XLA compute on every device (the defaults 'auto' pick bfloat16 and cuDNN attention
# on a GPU): the scanned and the unrolled model are compared at float32 tolerances.
F32 = {"model.dtype": "float32", "model.attention_impl": "xla"}


def _unstack(tree, num_layers):
  """{'h': stacked (L, ...)} -> {'h_0': ..., 'h_{L-1}': ...}; other entries unchanged."""
  out = {k: v for k, v in tree.items() if k != "h"}
  for i in range(num_layers):
    out[f"h_{i}"] = jax.tree.map(lambda a, i=i: a[i], tree["h"])
  return out


def _restack(tree, num_layers):
  """The inverse of _unstack."""
  out = {k: v for k, v in tree.items() if not k.startswith("h_")}
  out["h"] = jax.tree.map(lambda *a: jnp.stack(a), *[tree[f"h_{i}"] for i in range(num_layers)])
  return out


@pytest.mark.parametrize("method", ["dense", "s_ste"])
def test_scanned_model_without_prepared_collection_equals_unrolled(method):
  """Regression of the 'prepared' variable axis of nn.scan: the scanned model applies with no
  'prepared' collection (every backend but cuSPARSELt), forward and backward, and equals the
  unrolled model on the same (unstacked) variables."""
  L = 2
  over = {"model.num_layers": L, **F32}
  scanned = _model(method, overrides={**over, "model.scan_layers": True})
  unrolled = _model(method, overrides=over)
  tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, 50257)
  targets = jnp.roll(tokens, -1, axis=1)
  variables = jax.jit(scanned.init)(jax.random.key(0), tokens)
  assert sparse_linear.PREPARED not in variables
  assert set(variables["params"]["h"]["mlp"]["fc"]) == {"kernel", "bias"}
  assert variables["params"]["h"]["mlp"]["fc"]["kernel"].shape == (L, 128, 32)   # stacked
  if method == "s_ste":
    assert variables["sparsity"]["h"]["mlp"]["fc"]["mask"].shape == (L, 128, 32)
  flat = {col: _unstack(dict(tree), L) for col, tree in variables.items()}
  apply_scanned = jax.jit(scanned.apply)
  np.testing.assert_allclose(apply_scanned(variables, tokens),
                             jax.jit(unrolled.apply)(flat, tokens), rtol=1e-5, atol=1e-5)
  # An empty 'prepared' collection (what sparse_linear.prepare returns for 'xla') is the same.
  prepared = sparse_linear.prepare(scanned.config, variables["params"],
                                   variables.get("sparsity", {}), tokens=32, dtype=jnp.float32)
  assert prepared == {}
  np.testing.assert_array_equal(apply_scanned({**variables, sparse_linear.PREPARED: prepared},
                                              tokens), apply_scanned(variables, tokens))

  def loss(model, params, others):
    return model.apply({**others, "params": params}, tokens, targets,
                       rngs={"mvue": jax.random.key(4)})

  others = {k: v for k, v in variables.items() if k != "params"}
  g_scan = jax.jit(jax.grad(lambda p: loss(scanned, p, others)))(variables["params"])
  g_unrolled = jax.jit(jax.grad(lambda p: loss(unrolled, p, {k: flat[k] for k in others})))(
      flat["params"])
  for a, b in zip(jax.tree.leaves(g_scan), jax.tree.leaves(_restack(g_unrolled, L))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_scanned_model_slices_the_prepared_collection_per_layer():
  """With a backend that prepares (a stand-in for cuSPARSELt: it multiplies by the prepared
  2 W~, never by W~), the scanned model hands each layer its own slice of the stacked
  'prepared' collection: it equals the unrolled model with its own prepared collection, and
  differs from the model without one."""
  calls = []

  def prepare(w, *, tokens, dtype, opts, micro_batches):
    del tokens, dtype, opts
    return {"w2": 2.0 * w}

  def linear(opts, x, w, key, prepared):
    del opts, key
    calls.append(bool(prepared))
    return x @ (prepared["w2"] if prepared else w).T.astype(x.dtype)

  sparse_ops.register_backend("test_prepares", sparse_ops.Backend(linear=linear, prepare=prepare,
                                                                  needs_24=False))
  try:
    L = 2
    over = {"model.num_layers": L, "sparsity.backend": "test_prepares", **F32}
    scanned = _model("ste", overrides={**over, "model.scan_layers": True})
    unrolled = _model("ste", overrides=over)
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 50257)
    variables = jax.jit(scanned.init)(jax.random.key(0), tokens)
    flat = {col: _unstack(dict(tree), L) for col, tree in variables.items()}
    prep_scan = sparse_linear.prepare(scanned.config, variables["params"],
                                      variables["sparsity"], tokens=32, dtype=jnp.float32)
    prep_flat = sparse_linear.prepare(unrolled.config, flat["params"], flat["sparsity"],
                                      tokens=32, dtype=jnp.float32)
    assert prep_scan["h"]["mlp"]["fc"]["w2"].shape == (L, 128, 32)
    for i in range(L):   # the stacked entries are each layer's own 2 W~
      np.testing.assert_array_equal(prep_scan["h"]["mlp"]["proj"]["w2"][i],
                                    prep_flat[f"h_{i}"]["mlp"]["proj"]["w2"])
    assert not np.array_equal(prep_flat["h_0"]["mlp"]["fc"]["w2"],
                              prep_flat["h_1"]["mlp"]["fc"]["w2"])
    with_prep = jax.jit(scanned.apply)({**variables, sparse_linear.PREPARED: prep_scan}, tokens)
    np.testing.assert_allclose(
        with_prep, jax.jit(unrolled.apply)({**flat, sparse_linear.PREPARED: prep_flat}, tokens),
        rtol=1e-5, atol=1e-5)
    calls.clear()
    without = scanned.apply(variables, tokens)
    assert calls and not any(calls)             # no collection: every layer multiplies by W~
    assert not np.allclose(with_prep, without, atol=1e-3)
  finally:
    sparse_ops.backend._BACKENDS.pop("test_prepares")   # pylint: disable=protected-access


@pytest.mark.parametrize("precision,want", [("default", None), ("highest", "HIGHEST")])
def test_matmul_precision_sets_the_precision_of_the_models_dots(precision, want):
  """model.matmul_precision reaches every dot_general the model traces: 'default' leaves
  JAX's (None: TF32 for float32 on an NVIDIA GPU), 'highest' asks for true float32."""
  cfg = model_lib.ModelConfig(vocab_size=64, seq_len=8, num_layers=1, num_heads=2, d_model=16,
                              dtype="float32", matmul_precision=precision)
  model = model_lib.build(cfg)
  tokens = jnp.zeros((2, 8), jnp.int32)
  params = model.init(jax.random.key(0), tokens)
  text = str(jax.make_jaxpr(lambda p: model.apply(p, tokens))(params))
  assert "dot_general" in text
  if want is None:
    assert "HIGHEST" not in text
  else:
    assert text.count("dot_general") == text.count("precision=(Precision.HIGHEST, "
                                                   "Precision.HIGHEST)"), text[:2000]


def test_an_unknown_matmul_precision_names_the_valid_ones():
  with pytest.raises(ValueError, match="unknown model.matmul_precision 'tf32'; valid: default, "
                                       "high, highest"):
    model_lib.ModelConfig(matmul_precision="tf32")
