"""Tests of s24jax.kernels.venom: V:2:M activation sparsify / compress and its matmul, against
a NumPy brute force over every 4-column subset of each V x M block and the jnp reference."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import venom
from s24jax.kernels import _common as c
from s24jax.kernels import venom as vn
from s24jax.kernels._testing import MODES
from s24jax.kernels._testing import assert_lowers_to_triton

CFG = vn.VenomConfig()
REF = jax.jit(vn.venom_reference, static_argnums=(1, 2))
DECOMP = jax.jit(vn.venom_decompress, static_argnums=(3, 4))


def _fake_compressed(r, cdim, v, m, dtype=jnp.float32):
  """Right-shaped (values, meta, cols) without running anything."""
  blocks = cdim // m
  return (jnp.ones((r, 2 * blocks), dtype),
          jnp.full((r, -(-blocks // 8)), c.EMPTY_WORD, jnp.uint32),
          jnp.zeros((r // v, blocks, 4), jnp.int32) + jnp.arange(4))


def np_venom_dense(x, v, m):
  """Brute force: per V x M block, every 4-column subset; dense result."""
  x = np.asarray(x, np.float64)
  r, cdim = x.shape
  out = np.zeros_like(x)
  cols = np.zeros((r // v, cdim // m, 4), np.int64)
  for i, b in itertools.product(range(r // v), range(cdim // m)):
    blk = x[i * v:(i + 1) * v, b * m:(b + 1) * m]
    best, best_sub = -1.0, None
    for sub in itertools.combinations(range(m), 4):
      score = sum(sorted(np.abs(row[list(sub)]))[-2:][0]
                  + sorted(np.abs(row[list(sub)]))[-1] for row in blk)
      if score > best:        # first best subset in lexicographic order
        best, best_sub = score, sub
    cols[i, b] = best_sub
    for rr in range(v):
      vals = blk[rr, list(best_sub)]
      keep = sorted(range(4), key=lambda j: (-abs(vals[j]), j))[:2]
      for j in keep:
        out[i * v + rr, b * m + best_sub[j]] = vals[j]
  return out, cols


def _data(shape, seed=0):
  # Small integers: exact sums (the kernel and reference agree bit for bit)
  # and plenty of ties to exercise the tie rules.
  return jax.random.randint(jax.random.key(seed), shape, -4, 5).astype(
      jnp.float32)


# (rows, cols, v, m): the main 16:2:8 format; a padded 4:2:4 (9 blocks).
CASES = [(32, 128, 16, 8), (8, 36, 4, 4)]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("r,cdim,v,m", CASES)
def test_compress_and_matmul(interpret, r, cdim, v, m):
  x = _data((r, cdim))
  values, meta, cols = vn._venom(x, v=v, m=m, config=CFG, interpret=interpret,
                                 poison=True)
  blocks = cdim // m
  assert values.shape == (r, 2 * blocks)
  assert meta.shape == (r, -(-blocks // 8)) and meta.dtype == jnp.uint32
  assert cols.shape == (r // v, blocks, 4) and cols.dtype == jnp.int32
  ref = REF(x, v, m)
  for got, want in zip((values, meta, cols), ref):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  dense, bcols = np_venom_dense(x, v, m)
  np.testing.assert_array_equal(np.asarray(cols), bcols)
  got_dense = DECOMP(values, meta, cols, v, m)
  np.testing.assert_array_equal(np.asarray(got_dense), dense)
  # Every row keeps <= 2 per block, all inside the block's 4 shared columns.
  nz = (dense != 0).reshape(r // v, v, blocks, m)
  assert (nz.sum(-1) <= 2).all() and (nz.any(1).sum(-1) <= 4).all()

  w2 = jax.random.normal(jax.random.key(1), (24, cdim), jnp.float32)
  y = vn._vnm_matmul(values, meta, cols, w2, v=v, m=m, config=CFG,
                     interpret=interpret, poison=True)
  np.testing.assert_allclose(np.asarray(y), dense @ np.asarray(w2).T,
                             rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(
      np.asarray(y),
      np.asarray(vn.venom_matmul_reference(values, meta, cols, w2, v=v, m=m)),
      rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("interpret", MODES)
def test_public_api(interpret):
  x = _data((8, 36), seed=2)
  values, meta, cols = venom.venom_compress(x, 4, 4, interpret=interpret)
  for got, want in zip((values, meta, cols), REF(x, 4, 4)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  w2 = jnp.ones((16, 36), jnp.float32)
  y = venom.venom_matmul(values, meta, cols, w2, v=4, m=4,
                           interpret=interpret)
  np.testing.assert_allclose(
      np.asarray(y), np.asarray(DECOMP(values, meta, cols, 4, 4)
                                ).sum(1, keepdims=True).repeat(16, 1),
      rtol=1e-5)


def test_bad_inputs_are_errors():
  x = jnp.ones((8, 32))
  with pytest.raises(ValueError, match="multiple of v"):
    venom.venom_compress(jnp.ones((6, 32)), 4, 8, interpret=True)
  with pytest.raises(ValueError, match="multiple of m"):
    venom.venom_compress(jnp.ones((8, 36)), 4, 8, interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    venom.venom_compress(x, 3, 8, interpret=True)
  with pytest.raises(ValueError, match="4, 8, 16"):
    venom.venom_compress(x, 4, 32, interpret=True)
  values, meta, cols = _fake_compressed(8, 32, 4, 8)
  with pytest.raises(ValueError, match="w2"):
    venom.venom_matmul(values, meta, cols, jnp.ones((16, 16)), v=4, m=8)
  with pytest.raises(ValueError, match="share"):
    venom.venom_matmul(values, meta, cols, jnp.ones((16, 32), jnp.bfloat16),
                         v=4, m=8)


def test_lowers_to_triton():
  x = jnp.ones((256, 3072), jnp.bfloat16)
  w2 = jnp.ones((768, 3072), jnp.bfloat16)
  assert_lowers_to_triton(lambda x: venom.venom_compress(x, 16, 8), x,
                          expected_calls=1)
  _, meta, cols = _fake_compressed(256, 3072, 16, 8)
  values = jnp.ones((256, 768), jnp.bfloat16)
  assert_lowers_to_triton(
      lambda v, w: venom.venom_matmul(v, meta, cols, w, v=16, m=8),
      values, w2, expected_calls=1)
