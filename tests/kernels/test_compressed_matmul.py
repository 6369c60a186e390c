"""Tests of s24jax.kernels.compressed_matmul: the sparse24_matmul forward and custom_vjp
gradients (Pallas interpret mode on CPU), the dispatch heuristic and the input checks.
References: NumPy products of the decompressed W (np_decompress), the jnp reference's own
autodiff, and dvalues = dY^T x sampled at the kept positions by a NumPy loop."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import compressed_matmul
from s24jax.kernels import _common as c
from s24jax.kernels import compressed_matmul as sm
from s24jax.kernels import sparsify24 as sp
from s24jax.kernels._testing import MODES
from s24jax.kernels._testing import assert_lowers_to_triton
from s24jax.kernels._testing import np_decompress

CFG = sm.Sparse24MatmulConfig()
REF = jax.jit(sm.sparse24_matmul_reference)
COMPRESS = jax.jit(sp.compress24_reference)


def _operands(m, n, k, dtype=jnp.float32, seed=0):
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (m, k), dtype)
  values, meta = COMPRESS(jax.random.normal(kw, (n, k), dtype))
  dy = jax.random.normal(kd, (m, n), dtype)
  return x, values, meta, dy


# (tokens, out, in): tile-aligned, every axis padded, K % 64 != 0 and a
# single token.
SHAPES = [(16, 32, 128), (5, 48, 96), (1, 16, 132)]


def _call(interpret, config=CFG):
  def f(x, values, meta):
    return sm._sparse24_matmul(x, values, meta, interpret=interpret,
                               config=config, poison=True)
  return f


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_forward_and_gradients(interpret, m, n, k):
  x, values, meta, dy = _operands(m, n, k)
  f = _call(interpret)
  y, vjp = jax.vjp(lambda x, v: f(x, v, meta), x, values)
  assert y.shape == (m, n) and y.dtype == x.dtype
  w = np_decompress(values, meta)
  np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ w.T, rtol=1e-5,
                             atol=1e-4)
  np.testing.assert_allclose(np.asarray(y), np.asarray(REF(x, values, meta)),
                             rtol=1e-5, atol=1e-5)
  dx, dv = vjp(dy)
  rdx, rdv = jax.vjp(lambda x, v: sm.sparse24_matmul_reference(x, v, meta),
                     x, values)[1](dy)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(rdx), rtol=1e-5,
                             atol=1e-4)
  np.testing.assert_allclose(np.asarray(dv), np.asarray(rdv), rtol=1e-5,
                             atol=1e-4)
  # dvalues = dense dW = dy^T x sampled at the kept positions (NumPy).
  dw = np.asarray(dy).T @ np.asarray(x)
  nz = np_decompress(jnp.arange(values.size, dtype=jnp.float32).reshape(
      values.shape) + 1, meta)
  want = np.zeros(values.shape, np.float32)
  for (r, col) in zip(*np.nonzero(nz)):
    want.flat[int(nz[r, col]) - 1] = dw[r, col]
  np.testing.assert_allclose(np.asarray(dv), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("interpret", MODES)
def test_public_api_batch_dims_bf16_and_jax_grad(interpret):
  x, values, meta, _ = _operands(6, 32, 64, jnp.bfloat16, seed=1)
  x3 = x.reshape(2, 3, 64)
  y = compressed_matmul.sparse24_matmul(x3, values, meta, interpret=interpret)
  assert y.shape == (2, 3, 32) and y.dtype == jnp.bfloat16
  np.testing.assert_allclose(
      np.asarray(y, np.float32),
      np.asarray(REF(x3, values, meta), np.float32), rtol=2e-2, atol=2e-2)

  def loss(fn):
    return lambda x, v: jnp.sum(fn(x, v, meta).astype(jnp.float32) ** 2)
  g = jax.grad(loss(lambda x, v, m: compressed_matmul.sparse24_matmul(
      x, v, m, interpret=interpret)), argnums=(0, 1))(x3, values)
  gr = jax.grad(loss(sm.sparse24_matmul_reference), argnums=(0, 1))(x3, values)
  for a, b in zip(g, gr):
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(b, np.float32), rtol=5e-2, atol=5e-1)


def test_should_use_pallas_matmul():
  assert sm.should_use_pallas_matmul(16, 3072, 768, backend="gpu")
  assert sm.should_use_pallas_matmul(sm.PALLAS_MATMUL_MAX_TOKENS, 768, 3072,
                                     backend="gpu")
  assert not sm.should_use_pallas_matmul(sm.PALLAS_MATMUL_MAX_TOKENS + 1, 768,
                                         3072, backend="gpu")
  assert not sm.should_use_pallas_matmul(16, 3072, 768, backend="cpu")
  assert not sm.should_use_pallas_matmul(16, 3072, 100, backend="gpu")
  assert not sm.should_use_pallas_matmul(0, 3072, 768, backend="gpu")


def test_bad_inputs_are_errors():
  x, values, meta, _ = _operands(4, 16, 64)
  with pytest.raises(ValueError, match="must equal"):
    compressed_matmul.sparse24_matmul(x[:, :32], values, meta, interpret=True)
  with pytest.raises(ValueError, match="share"):
    compressed_matmul.sparse24_matmul(x.astype(jnp.bfloat16), values, meta,
                            interpret=True)
  with pytest.raises(ValueError, match="meta shape"):
    compressed_matmul.sparse24_matmul(x, values, meta[:, :1], interpret=True)
  with pytest.raises(ValueError, match="2-D"):
    compressed_matmul.sparse24_matmul(x, values[None], meta[None], interpret=True)
  with pytest.raises(ValueError, match="multiple of 4"):
    compressed_matmul.sparse24_matmul(jnp.ones((2, 6)), jnp.ones((4, 3)),
                            jnp.zeros((4, 1), jnp.uint32), interpret=True)


def test_lowers_to_triton_forward_and_backward():
  x = jnp.ones((16, 768), jnp.bfloat16)
  values = jnp.ones((3072, 384), jnp.bfloat16)
  meta = jnp.full((3072, 24), c.EMPTY_WORD, jnp.uint32)

  def loss(x, v):
    return compressed_matmul.sparse24_matmul(x, v, meta).astype(jnp.float32).sum()
  assert_lowers_to_triton(lambda x, v: compressed_matmul.sparse24_matmul(x, v, meta),
                          x, values, expected_calls=1)
  # forward + dx + dvalues (value_and_grad keeps the forward alive).
  assert_lowers_to_triton(jax.value_and_grad(loss, argnums=(0, 1)), x, values,
                          expected_calls=3)
