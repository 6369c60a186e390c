"""Tests of s24jax.kernels.sparsify24: compress24 / soft_compress24 / decompress24.

Checked against the jnp reference, a brute-force NumPy search per group, and
s24jax.kernels.masks.nm_mask; kernel outputs are poisoned (NaN / all-ones) first so
an unwritten element fails the full-array comparison.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import sparsify24
from s24jax.kernels import _common as c
from s24jax.kernels import sparsify24 as sp
from s24jax.kernels._testing import MODES
from s24jax.kernels._testing import assert_lowers_to_triton
from s24jax.kernels._testing import np_pack_meta
from s24jax.kernels.masks import nm_mask

CFG = sp.Sparsify24Config()
# Jitted references: eager op-by-op dispatch would dominate the test time.
REF = jax.jit(sp.compress24_reference)
SOFT_REF = jax.jit(sp.soft_compress24_reference)
SOFT_DENSE = jax.jit(sp.soft_threshold24_reference)
DECOMP = jax.jit(sparsify24.decompress24)
HARD_DENSE = jax.jit(lambda w: jnp.where(nm_mask(w), w, 0))


def np_compress(w, positions_fn, value_fn=None):
  """Brute force: per group, positions_fn(group) -> 2 sorted positions."""
  w = np.asarray(w, np.float32)
  lead, k = w.shape[:-1], w.shape[-1]
  groups = w.reshape(-1, k // 4, 4)
  idx = np.zeros(groups.shape[:2] + (2,), np.int64)
  vals = np.zeros(groups.shape[:2] + (2,), np.float32)
  for r in range(groups.shape[0]):
    for g in range(groups.shape[1]):
      grp = groups[r, g]
      pos = sorted(positions_fn(grp))
      idx[r, g] = pos
      vv = value_fn(grp) if value_fn else grp
      vals[r, g] = vv[pos]
  meta = np_pack_meta(idx, k).reshape(*lead, -1)
  return vals.reshape(*lead, k // 2), meta


def top2_positions(grp):
  return sorted(range(4), key=lambda j: (-abs(grp[j]), j))[:2]


def soft_values(beta):
  def fn(grp):
    t = np.sort(np.abs(grp))[1]
    return beta * np.sign(grp) * np.maximum(np.abs(grp) - t, 0)
  return fn


def _data(shape, dtype, kind, seed=0):
  key = jax.random.key(seed)
  if kind == "ties":   # small integers: many exact ties
    return jax.random.randint(key, shape, -2, 3).astype(dtype)
  return jax.random.normal(key, shape, dtype)


SHAPES = [((8, 64), jnp.float32, "normal"), ((3, 36), jnp.bfloat16, "ties"),
          ((2, 3, 100), jnp.float32, "ties")]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("shape,dtype,kind", SHAPES)
def test_hard_threshold_matches_brute_force(interpret, shape, dtype, kind):
  w = _data(shape, dtype, kind)
  values, meta = sp._sparsify24(w, None, None, mode="hard", config=CFG,
                                interpret=interpret, poison=True)
  assert values.shape == shape[:-1] + (shape[-1] // 2,) and values.dtype == dtype
  assert meta.shape == shape[:-1] + (c.meta_words(shape[-1]),)
  assert meta.dtype == jnp.uint32
  bv, bm = np_compress(w, top2_positions)
  np.testing.assert_array_equal(np.asarray(values, np.float32), bv)
  np.testing.assert_array_equal(np.asarray(meta), bm)
  rv, rm = REF(w)
  np.testing.assert_array_equal(np.asarray(values), np.asarray(rv))
  np.testing.assert_array_equal(np.asarray(meta), np.asarray(rm))
  # Round trip = the project's hard-threshold mask applied to w.
  dense = DECOMP(values, meta)
  np.testing.assert_array_equal(np.asarray(dense),
                                np.asarray(HARD_DENSE(w)))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("shape,dtype,kind", SHAPES[:2])
def test_given_mask(interpret, shape, dtype, kind):
  w = _data(shape, dtype, kind, seed=1)
  # A 2:4 mask that is *not* the magnitude mask, with some groups holding
  # fewer than two entries (topped up with zero-valued slots).
  rnd = jax.random.uniform(jax.random.key(2), shape)
  mask = nm_mask(rnd) & (jax.random.uniform(jax.random.key(3), shape) < 0.8)
  values, meta = sp._sparsify24(w, mask, None, mode="mask", config=CFG,
                                interpret=interpret, poison=True)
  rv, rm = REF(w, mask)
  np.testing.assert_array_equal(np.asarray(values), np.asarray(rv))
  np.testing.assert_array_equal(np.asarray(meta), np.asarray(rm))
  dense = DECOMP(values, meta)
  np.testing.assert_array_equal(np.asarray(dense),
                                np.asarray(jnp.where(mask, w, 0)))
  # Brute force for the positions: kept first, then lowest index.
  m = np.asarray(mask).reshape(-1, shape[-1] // 4, 4)
  flat_w = np.asarray(w, np.float32).reshape(-1, shape[-1])
  it = iter(range(m.shape[0] * m.shape[1]))

  def pos_fn(grp):
    i = next(it)
    mm = m[i // m.shape[1], i % m.shape[1]]
    return sorted(range(4), key=lambda j: (not mm[j], j))[:2]

  _, bm = np_compress(flat_w, pos_fn)
  np.testing.assert_array_equal(np.asarray(meta).reshape(bm.shape), bm)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("shape,dtype,kind", [SHAPES[0], SHAPES[2]])
def test_soft_threshold(interpret, shape, dtype, kind):
  w = _data(shape, dtype, kind, seed=4)
  beta = 0.75
  values, meta = sp._sparsify24(w, None, beta, mode="soft", config=CFG,
                                interpret=interpret, poison=True)
  bv, bm = np_compress(w, top2_positions, soft_values(beta))
  np.testing.assert_allclose(np.asarray(values, np.float32), bv, rtol=1e-6,
                             atol=1e-7)
  np.testing.assert_array_equal(np.asarray(meta), bm)
  rv, rm = SOFT_REF(w, beta)
  np.testing.assert_array_equal(np.asarray(values), np.asarray(rv))
  np.testing.assert_array_equal(np.asarray(meta), np.asarray(rm))
  np.testing.assert_array_equal(
      np.asarray(DECOMP(values, meta)), np.asarray(SOFT_DENSE(w, beta)))


@pytest.mark.parametrize("interpret", MODES)
def test_public_api_and_small_blocks(interpret):
  """The public names, with non-default (tiny) blocks: several programs."""
  w = _data((8, 64), jnp.float32, "normal")
  cfg = sp.Sparsify24Config(block_rows=2, block_cols=32)
  got = sparsify24.compress24(w, interpret=interpret, config=cfg)
  want = REF(w)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Under jit the mask is a tracer (no concrete 2:4 check possible).
  got_m = jax.jit(lambda w, m: sparsify24.compress24(
      w, m, interpret=interpret, config=cfg))(w, nm_mask(w))
  for a, b in zip(got_m, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  got_s = sparsify24.soft_compress24(w, jnp.float32(2.0), interpret=interpret,
                                  config=cfg)
  for a, b in zip(got_s, SOFT_REF(w, 2.0)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_all_equal_group_keeps_lowest_indices():
  w = jnp.ones((1, 8))
  values, meta = REF(w)
  nib = np.asarray(c.unpack_nibbles(meta))[0, :2]
  assert list(nib) == [c.EMPTY_NIBBLE] * 2   # (0, 1) for both groups


@pytest.mark.parametrize("bad", [(4, 6), (4, 30), (7,)])
def test_k_not_multiple_of_four_is_an_error(bad):
  with pytest.raises(ValueError, match="multiple of 4"):
    sparsify24.compress24(jnp.ones(bad), interpret=True)
  with pytest.raises(ValueError, match="multiple of 4"):
    sparsify24.soft_compress24(jnp.ones(bad), interpret=True)


def test_bad_inputs_are_errors():
  with pytest.raises(ValueError, match="floating"):
    sparsify24.compress24(jnp.ones((4, 8), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="mask shape"):
    sparsify24.compress24(jnp.ones((4, 8)), jnp.ones((4, 4), bool), interpret=True)
  too_many = jnp.array([[True, True, True, False]])
  with pytest.raises(ValueError, match="not 2:4"):
    sparsify24.compress24(jnp.ones((1, 4)), too_many, interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    sp.Sparsify24Config(block_rows=3)
  with pytest.raises(ValueError, match=">= 32"):
    sp.Sparsify24Config(block_cols=16)


@pytest.mark.parametrize("mode", sp.MODES)
def test_lowers_to_triton(mode):
  w = jnp.ones((64, 768), jnp.bfloat16)
  mask = nm_mask(w)

  def f(w, mask):
    return sp._sparsify24(w, mask if mode == "mask" else None,
                          0.5 if mode == "soft" else None, mode=mode,
                          config=CFG, interpret=False)
  assert_lowers_to_triton(f, w, mask, expected_calls=1)
