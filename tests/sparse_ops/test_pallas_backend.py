"""Tests of s24jax/sparse_ops/pallas.py, sparsity.backend='pallas' / 'pallas_always': the
Pallas kernels (kernels/) inside the three-GEMM sparse op.

On CPU the kernels run in Pallas interpret mode, chosen automatically, so these tests run the
very code the GPU runs (`pallas_always` forces it: the 'pallas' heuristic picks XLA off a
GPU). References: plain NumPy float64 formulas (y = x W~^T, dX = dY W~, dW~ = dY^T x) and the
'xla' backend, itself tested against such formulas in tests/sparse_ops/test_op.py. The `gpu` twins run
the same checks natively (bf16 compute as the model uses on GPU) and are skipped here.
"""
from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax import sparse_ops
from s24jax.kernels import compressed_matmul
from s24jax.methods import registry
from s24jax.nn.sparse_linear import SparseLinear
from s24jax.nn.sparse_linear import SparsityConfig
from s24jax.sparse_ops import pallas
from s24jax.sparse_ops import xla
from s24jax.sparse_ops.options import GemmOptions

from tiny import tiny_config

from ops_helpers import SHAPES, assert_bf16_op_matches_xla, normal, op, sparse_w, train_losses

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")


@pytest.mark.parametrize("tokens,out,inp", SHAPES)
def test_pallas_op_matches_formulas_and_xla(tokens, out, inp):
  x, w, dy = normal(0, (tokens, inp)), sparse_w(1, (out, inp)), normal(2, (tokens, out))
  y, dx, dw = op("pallas_always", x, w, dy)
  xn, wn, dyn = (np.asarray(a, np.float64) for a in (x, w, dy))
  np.testing.assert_allclose(y, xn @ wn.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, dyn @ wn, rtol=1e-5, atol=1e-5)
  # The weight gradient is the DENSE dL/dW~ = dY^T x, also where W~ is pruned: what
  # straight-through projections pass on to the latent W (the kernel's dvalues would be 0 there).
  pruned = np.asarray(w) == 0
  np.testing.assert_allclose(dw, dyn.T @ xn, rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(dw)[pruned]).min() > 0
  for got, want in zip((y, dx, dw), op("xla", x, w, dy)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pallas_op_mvue_weight_gradient_equals_xla():
  """Same key: the MVUE estimate of dY^T (drawn by the shared wgrad helper) is the same."""
  tokens, out, inp = SHAPES[0]      # the kernels compiled for the test above are reused
  x, w, dy = normal(3, (tokens, inp)), sparse_w(4, (out, inp)), normal(5, (tokens, out))
  key = jax.random.PRNGKey(7)
  got = op("pallas_always", x, w, dy, key, mvue=True)
  want = op("xla", x, w, dy, key, mvue=True)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
  # And it is an estimate, not the exact dY^T x (MVUE is really on in the Pallas path).
  assert not np.allclose(got[2], np.asarray(dy).T @ np.asarray(x), atol=1e-3)


def test_layer_with_pallas_backend_matches_xla():
  """Through SparseLinear (the dispatch point), leading batch axes, bias, and S-STE's
  straight-through backward to the latent W."""
  tokens, out, inp = SHAPES[0]      # as 2 x 8 tokens: the compiled kernels are reused
  x, dy = normal(0, (2, tokens // 2, inp)), normal(1, (2, tokens // 2, out))  # (B, T, in/out)
  results = {}
  for backend in ("xla", "pallas_always"):
    cfg = SparsityConfig(method=registry.get_method("s_ste"), sparse_layers=("*",),
                         backend=backend)
    layer = SparseLinear(out, cfg, name="fc")
    variables = flax.core.unfreeze(layer.init(jax.random.PRNGKey(1), x))

    def f(params, x, variables=variables, layer=layer):
      return layer.apply({**variables, "params": params}, x)

    y, vjp = jax.vjp(f, variables["params"], x)
    results[backend] = (y, *vjp(dy))
  for got, want in zip(jax.tree.leaves(results["pallas_always"]), jax.tree.leaves(results["xla"])):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _which(name, tokens, out, inp):
  """Which path the backend `name` takes for x (tokens, in), W~ (out, in): 'kernels' when it
  calls pallas.linear_2d, 'xla' when it calls xla.linear (both replaced by recorders, traced
  abstractly; the 'xla' Backend holds the function itself, so it records nothing)."""
  taken = []
  x, w = jnp.zeros((tokens, inp)), jnp.zeros((out, inp))
  real_kernels, real_xla = pallas.linear_2d, xla.linear
  try:
    pallas.linear_2d = lambda *a: taken.append("kernels")
    xla.linear = lambda *a: taken.append("xla")
    jax.eval_shape(lambda x, w: sparse_ops.get_backend(name).linear(
        GemmOptions(backend=name), x, w, None, {}), x, w)
  finally:
    pallas.linear_2d, xla.linear = real_kernels, real_xla
  return taken


def test_backend_dispatch():
  # 'pallas' defers to the kernels' heuristic, which never picks Pallas off a GPU.
  on_gpu = jax.default_backend() == "gpu"
  assert compressed_matmul.should_use_pallas_matmul(16, 3072, 768) == on_gpu
  assert _which("pallas", 16, 3072, 768) == (["kernels"] if on_gpu else ["xla"])
  assert not compressed_matmul.should_use_pallas_matmul(1 << 20, 3072, 768)   # compute-bound
  assert _which("pallas", 1 << 20, 3072, 768) == ["xla"]
  assert _which("pallas_always", 1 << 20, 12, 40) == ["kernels"]
  assert _which("pallas_always", 16, 3072, 768) == ["kernels"]
  assert "kernels" not in _which("xla", 16, 3072, 768)             # never the kernels


def test_backend_errors_name_the_problem():
  with pytest.raises(ValueError, match="sparsity.backend 'cuSPARSELt'; valid: xla, pallas, "
                                       "pallas_always, tcgen05, cusparselt"):
    SparsityConfig(backend="cuSPARSELt")
  x, w = normal(0, (4, 6)), normal(1, (8, 6))                        # in = 6: not 2:4-able
  with pytest.raises(ValueError, match="in_features, here 6"):
    sparse_ops.sparse_linear(x, w, opts=GemmOptions(backend="pallas_always"))
  for backend in ("pallas", "pallas_always"):
    with pytest.raises(ValueError, match=f"sparsity.fp8 is not supported by "
                                         f"sparsity.backend='{backend}' \\(its kernels have no "
                                         f"FP8 path\\); use sparsity.backend='xla' or "
                                         f"'cusparselt'."):
      SparsityConfig(method=registry.get_method("s_ste"), backend=backend, fp8=True)


# ---------------------------------------------------------------------------------------------
# A tiny model trained with each backend.


def _train_losses(backend, steps=3):
  c = tiny_config("s_ste", overrides={"sparsity.backend": backend, "sparsity.mvue": True})
  c.model.vocab_size = 64
  return train_losses(c, steps)


def test_tiny_training_with_pallas_matches_xla():
  """S-STE + MVUE, 3 AdamW steps: same losses and same latent weights. A Pallas path whose
  weight gradient were the kernel's dvalues (zero at pruned positions) would leave the
  pruned latent weights where they started and fail the parameter comparison."""
  pallas_losses, pallas_params = _train_losses("pallas_always")
  xla_losses, xla_params = _train_losses("xla")
  assert all(np.isfinite(pallas_losses))
  np.testing.assert_allclose(pallas_losses, xla_losses, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(pallas_params), jax.tree.leaves(xla_params)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# GPU twins: native Triton kernels (interpret=False chosen automatically), bf16 as on the model.


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,out,inp", SHAPES + [(64, 3072, 768)])
def test_gpu_pallas_op_matches_xla(tokens, out, inp):
  assert_bf16_op_matches_xla("pallas_always", tokens, out, inp)


@pytest.mark.gpu
def test_gpu_tiny_training_with_pallas_matches_xla():
  pallas_losses, _ = _train_losses("pallas_always", steps=5)
  xla_losses, _ = _train_losses("xla", steps=5)
  np.testing.assert_allclose(pallas_losses, xla_losses, rtol=2e-2)
