"""Tests of s24jax.sparse_ops: the three-GEMM sparse linear op through its 'xla' reference
backend (xla.py, the GEMMs and the MVUE operand of common.py, GemmOptions of options.py) and
the backend registry (backend.py: get_backend, register_backend, check, needs_24).

References are plain jnp / NumPy written from the formulas (y = x W~^T, dX = dY W~,
dW~ = dY^T x) at HIGHEST precision, a z-test of the MVUE weight gradient's mean against the
exact dY^T x, and, for the registry, a recording backend that delegates to the reference.
The other backends are tested against 'xla' in the other files of this folder.
"""
from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.nn import losses
from s24jax import sparse_ops
from s24jax.training import train
from s24jax.methods import registry
from s24jax.nn.model import GPT2
from s24jax.training.run_spec import RunSpec
from s24jax.nn.sparse_linear import SparseLinear
from s24jax.nn.sparse_linear import SparsityConfig
from s24jax.sparse_ops import backend as backend_lib
from s24jax.sparse_ops import xla
from s24jax.sparse_ops.options import GemmOptions

from tiny import tiny_config

from ops_helpers import normal

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")

HI = jax.lax.Precision.HIGHEST
MVUE = GemmOptions(mvue=True)


def _mm(a, b):
  return jnp.matmul(a, b, precision=HI)


def _assert_formulas(x, w, dy, y, dx, dw):
  """y = x W~^T, dX = dY W~, dW~ = dY^T x for x, dy of shape (B, T, in), (B, T, out)."""
  np.testing.assert_allclose(y, jnp.einsum("bti,oi->bto", x, w, precision=HI), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(dx, jnp.einsum("bto,oi->bti", dy, w, precision=HI), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(dw, jnp.einsum("bto,bti->oi", dy, x, precision=HI), rtol=1e-5,
                             atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The three-GEMM op on the 'xla' backend (the default GemmOptions).


def test_op_matches_reference_for_unstructured_weight_and_leading_dims():
  """The op itself does not assume a mask: any W~, any leading dims of x."""
  x, w, dy = normal(3, (3, 2, 8)), normal(4, (4, 8)), normal(5, (3, 2, 4))
  y, vjp = jax.vjp(lambda x, w: sparse_ops.sparse_linear(x, w), x, w)
  dx, dw = vjp(dy)
  _assert_formulas(x, w, dy, y, dx, dw)


def _grads_with_mvue(x, w, dy, key):
  _, vjp = jax.vjp(lambda x, w: sparse_ops.sparse_linear(x, w, key, opts=MVUE), x, w)
  return vjp(dy)


def test_mvue_estimate_of_dy_transposed_is_24_along_tokens():
  """With x = I (tokens = in), dW = est(dY^T) x is the estimate itself: 2:4 along tokens."""
  n, out = 16, 8
  dy = normal(6, (n, out))                                       # (N, out)
  _, dw = _grads_with_mvue(jnp.eye(n), normal(7, (out, n)), dy, jax.random.PRNGKey(0))
  groups = np.asarray(dw).reshape(out, n // 4, 4)                # (out, N/4, 4) along tokens
  nnz = (groups != 0).sum(-1)
  assert nnz.max() <= 2 and (nnz == 2).all()                     # dy has no zeros
  # The kept entries are rescaled dY^T entries: x_i / p_i with p_i <= 1, same sign.
  kept = dw != 0
  ratio = np.asarray(dw)[kept] / np.asarray(dy.T)[kept]
  assert (ratio >= 1 - 1e-6).all()


def test_mvue_weight_gradient_is_unbiased_and_data_gradient_exact():
  n, d_in, out, draws = 8, 4, 4, 4000
  x, w, dy = normal(8, (n, d_in)), normal(9, (out, d_in)), normal(10, (n, out))
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
  x, w = normal(0, (6, 4)), normal(1, (4, 4))
  with pytest.raises(ValueError, match="rngs=\\{'mvue'"):
    jax.grad(lambda w: sparse_ops.sparse_linear(x[:4], w, None, opts=MVUE).sum())(w)
  with pytest.raises(ValueError, match="multiple of 4"):      # 6 tokens
    jax.grad(lambda w: sparse_ops.sparse_linear(x, w, jax.random.PRNGKey(0),
                                                opts=MVUE).sum())(w)
  with pytest.raises(ValueError, match="valid: xla"):
    sparse_ops.sparse_linear(x, w, opts=GemmOptions(backend="cusparse"))


# ---------------------------------------------------------------------------------------------
# MVUE keys in training: per step from train_step's rngs={'mvue': ...}.


def _tiny(method, overrides=None):
  c = tiny_config(method, overrides=overrides)
  c.model.vocab_size = 64
  return c


def _fresh(config):
  spec = RunSpec.build(config)
  model = GPT2(spec.model_cfg)
  state = train.fresh_state(model, spec.tx, config.seed)
  return model, spec.tx(state.params, state.sparsity), state


def _batch(rng):
  tokens = rng.integers(0, 64, size=(4, 17))
  return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def test_mvue_keys_differ_per_step_and_repeat_within_a_step():
  """Same weights, two steps' rng -> different weight gradients; identical steps agree."""
  config = _tiny("t_sr_ste", {"sparsity.mvue": True})
  model, _, state = _fresh(config)
  batch = _batch(np.random.default_rng(1))

  @jax.jit
  def grads(step):
    rng = jax.random.fold_in(jax.random.fold_in(state.rng, step), train._MVUE_STREAM)
    def loss(params):
      logits = model.apply({"params": params, "sparsity": state.sparsity}, batch["inputs"],
                           rngs={"mvue": rng})
      return losses.cross_entropy_sum(logits, batch["targets"])
    return jax.grad(loss)(state.params)["h_0"]["mlp"]

  g0, g0_again, g1 = grads(0), grads(0), grads(1)
  np.testing.assert_array_equal(g0["fc"]["kernel"], g0_again["fc"]["kernel"])
  assert (g0["fc"]["kernel"] != g1["fc"]["kernel"]).any()
  np.testing.assert_array_equal(g0["fc"]["bias"], g1["fc"]["bias"])   # bias grad: dense, exact


# ---------------------------------------------------------------------------------------------
# The backend registry.


BUILT_IN = ("xla", "pallas", "pallas_always", "tcgen05", "cusparselt")


def test_unknown_backend_error_lists_the_valid_names():
  assert set(BUILT_IN) <= set(sparse_ops.available_backends())
  with pytest.raises(ValueError, match="unknown sparsity.backend 'nope'; valid: xla, pallas, "
                                       "pallas_always, tcgen05, cusparselt") as e:
    sparse_ops.get_backend("nope")
  for name in sparse_ops.available_backends():
    assert name in str(e.value)
  with pytest.raises(ValueError, match="unknown sparsity.backend 'nope'"):
    SparsityConfig(method=registry.get_method("ste"), backend="nope")
  assert sparse_ops.get_backend("xla") is xla.BACKEND


@pytest.fixture
def restore_backends(monkeypatch):
  """The registry as it was, after the test (a copy is what the test registers into)."""
  monkeypatch.setattr(backend_lib, "_BACKENDS", dict(backend_lib._BACKENDS))


def test_a_registered_backend_is_the_one_the_op_and_the_layer_call(restore_backends):
  calls = []

  def linear(opts, x, w, key, prepared):
    calls.append((opts, x.shape, w.shape, key is None, dict(prepared)))
    return xla.linear(opts, x, w, key, prepared)

  mine = sparse_ops.Backend(linear=linear)
  sparse_ops.register_backend("mine", mine)
  assert "mine" in sparse_ops.available_backends()
  assert sparse_ops.get_backend("mine") is mine
  with pytest.raises(ValueError, match="'mine' is already registered"):
    sparse_ops.register_backend("mine", mine)

  # The op: the new backend's linear, with the options, x flattened to 2-D and {} prepared;
  # and its result (and gradient) is the reference's, which it delegates to.
  opts = GemmOptions(backend="mine")
  x, w, dy = normal(0, (2, 3, 8)), normal(1, (4, 8)), normal(2, (2, 3, 4))
  y, vjp = jax.vjp(lambda x, w: sparse_ops.sparse_linear(x, w, opts=opts), x, w)
  dx, dw = vjp(dy)
  assert calls == [(opts, (6, 8), (4, 8), True, {})]
  _assert_formulas(x, w, dy, y, dx, dw)

  # The layer: a SparsityConfig naming it is accepted, and a sparse layer's apply calls it
  # with the config's GemmOptions (init runs the reference: shapes only).
  cfg = SparsityConfig(method=registry.get_method("ste"), sparse_layers=("*",), backend="mine")
  assert cfg.gemm.backend == "mine"
  layer = SparseLinear(4, cfg, name="fc")
  calls.clear()
  variables = layer.init(jax.random.PRNGKey(0), x)
  assert calls == []
  layer.apply(variables, x)
  assert len(calls) == 1 and calls[0][0] == cfg.gemm

  # overwrite=True replaces it.
  other = sparse_ops.Backend(linear=xla.linear, needs_24=False)
  sparse_ops.register_backend("mine", other, overwrite=True)
  assert sparse_ops.get_backend("mine") is other


def test_the_fixture_left_the_registry_as_it_was():
  # Runs after the test above (file order): 'mine' is gone again.
  assert "mine" not in sparse_ops.available_backends()
  assert set(BUILT_IN) <= set(sparse_ops.available_backends())


@pytest.mark.parametrize("backend", ["pallas", "pallas_always", "tcgen05"])
def test_backend_check_refusal_is_raised_when_the_config_is_built(backend):
  ste = registry.get_method("ste")
  opts = GemmOptions(fp8=True, backend=backend)     # the options alone are fine ...
  with pytest.raises(ValueError, match=f"sparsity.fp8 is not supported by "
                                       f"sparsity.backend='{backend}' \\(its kernels have no "
                                       f"FP8 path\\); use sparsity.backend='xla' or "
                                       f"'cusparselt'."):
    sparse_ops.check(opts)                          # ... the backend refuses them
  with pytest.raises(ValueError, match=f"sparsity.backend='{backend}' \\(its kernels"):
    SparsityConfig(method=ste, backend=backend, fp8=True)
  SparsityConfig(method=ste, backend=backend)       # without FP8: accepted
  for ok in ("xla", "cusparselt"):                  # the backends with an FP8 path
    SparsityConfig(method=ste, backend=ok, fp8=True)


def test_a_registered_backends_check_is_called(restore_backends):
  seen = []

  def check(opts):
    seen.append(opts)
    if opts.mvue:
      raise ValueError("backend 'picky' has no MVUE")

  sparse_ops.register_backend("picky", sparse_ops.Backend(linear=xla.linear, check=check))
  ste = registry.get_method("ste")
  cfg = SparsityConfig(method=ste, backend="picky")
  assert seen == [cfg.gemm]
  with pytest.raises(ValueError, match="backend 'picky' has no MVUE"):
    SparsityConfig(method=ste, backend="picky", mvue=True)


def test_needs_24_refuses_an_unstructured_method_off_xla(restore_backends):
  mst = registry.get_method("mst")
  assert not mst.structured_24
  for backend in ("pallas", "pallas_always", "tcgen05", "cusparselt"):
    assert sparse_ops.get_backend(backend).needs_24
    with pytest.raises(ValueError, match=f"sparsity.backend='{backend}' needs 2:4 weights; "
                                         "method 'mst' is unstructured: use "
                                         "sparsity.backend='xla'"):
      SparsityConfig(method=mst, backend=backend)
  assert not sparse_ops.get_backend("xla").needs_24
  SparsityConfig(method=mst, backend="xla")
  # A registered backend: needs_24 (the default) refuses it too, needs_24=False takes it.
  sparse_ops.register_backend("any_w", sparse_ops.Backend(linear=xla.linear, needs_24=False))
  sparse_ops.register_backend("only_24", sparse_ops.Backend(linear=xla.linear))
  SparsityConfig(method=mst, backend="any_w")
  with pytest.raises(ValueError, match="'only_24' needs 2:4 weights"):
    SparsityConfig(method=mst, backend="only_24")
