"""GPT-2 shapes, the sparse/dense equivalence, and clear errors for bad widths."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax import model as model_lib
from s24jax.model import GPT2

from tiny import tiny_config


def _model(projection="s_ste", **kw):
  return GPT2(model_lib.model_config(tiny_config(projection, **kw)))


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
  assert "sparsity" not in _model("dense").init(jax.random.key(0), tokens)


def test_sparse_model_with_dense_projection_equals_dense_model():
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 50257)
  dense = _model("dense", sparsity__sparse_layers=())
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
  model = _model("ste", model__d_model=30, model__num_heads=2)
  with pytest.raises(ValueError, match=r"h_0/mlp/fc.*30.*multiple of 4"):
    model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


def test_gated_ffn_makes_all_three_matrices_sparse():
  model = _model("ste", model__activation="swiglu")
  v = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  assert v["params"]["h_0"]["mlp"]["fc"]["kernel"].shape == (2 * 128, 32)   # value | gate
  assert set(v["sparsity"]["h_0"]["mlp"]) == {"fc", "proj"}


def test_unknown_activation_lists_valid():
  with pytest.raises(ValueError, match="gelu.*relu2.*swiglu"):
    dataclasses.replace(model_lib.ModelConfig(), activation="tanh")
