"""Tests of s24jax.kernels.transposable_mask: the 90-pattern transposable 2:4 mask (+ its
compressed forms), against a brute force over all 2^16 4x4 0/1 matrices (the best kept |w|
per block) and the jnp reference."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import sparsify24
from s24jax.kernels import transposable_mask
from s24jax.kernels import _common as c
from s24jax.kernels import transposable_mask as tm
from s24jax.kernels._testing import MODES
from s24jax.kernels._testing import assert_lowers_to_triton

CFG = tm.TransposableMaskConfig()
REF = jax.jit(tm.transposable_mask_reference)
REF_COMPRESSED = jax.jit(tm.transposable_compressed_reference)
DECOMP = jax.jit(sparsify24.decompress24)


def _all_patterns_brute_force():
  """Every 4x4 0/1 matrix with two ones per row and column (of 2^16)."""
  out = []
  for bits in range(1 << 16):
    p = np.array([(bits >> i) & 1 for i in range(16)]).reshape(4, 4)
    if (p.sum(0) == 2).all() and (p.sum(1) == 2).all():
      out.append(p)
  return np.stack(out)


BRUTE = _all_patterns_brute_force()


def test_pattern_enumeration():
  assert len(BRUTE) == 90 == len(tm.PATTERN_MATRIX) == len(tm.PATTERN_CODES)
  ours = {tuple(r) for r in tm.PATTERN_MATRIX.astype(int)}
  assert ours == {tuple(p.reshape(16)) for p in BRUTE}
  for p, code in enumerate(tm.PATTERN_CODES):
    bits = [(code >> i) & 1 for i in range(16)]
    np.testing.assert_array_equal(bits, tm.PATTERN_MATRIX[p])


def _np_best_scores(w):
  """Brute force: per 4x4 block, the best achievable kept |w| sum."""
  a = np.abs(np.asarray(w, np.float64))
  r, k = a.shape
  best = np.zeros((r // 4, k // 4))
  for i, j in itertools.product(range(r // 4), range(k // 4)):
    blk = a[4 * i:4 * i + 4, 4 * j:4 * j + 4]
    best[i, j] = max((p * blk).sum() for p in BRUTE)
  return best


def _check_transposable(mask):
  m = np.asarray(mask)
  r, k = m.shape
  assert (m.reshape(r, k // 4, 4).sum(-1) == 2).all()
  assert (m.T.reshape(k, r // 4, 4).sum(-1) == 2).all()


def _block_scores(w, mask):
  a = np.abs(np.asarray(w, np.float64)) * np.asarray(mask)
  r, k = a.shape
  return a.reshape(r // 4, 4, k // 4, 4).sum((1, 3))


# Integer data (exact sums, lots of ties) and real data; non-square, padded.
CASES = [((8, 12), "int"), ((36, 40), "int"), ((32, 64), "normal")]


def _data(shape, kind, seed=0):
  key = jax.random.key(seed)
  if kind == "int":
    return jax.random.randint(key, shape, -3, 4).astype(jnp.float32)
  return jax.random.normal(key, shape, jnp.float32)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("shape,kind", CASES)
def test_mask_is_optimal_and_matches_reference(interpret, shape, kind):
  w = _data(shape, kind)
  mask = tm._transposable(w, with_compressed=False, config=CFG,
                          interpret=interpret, poison=True)
  assert mask.shape == shape and mask.dtype == jnp.bool_
  _check_transposable(mask)
  np.testing.assert_allclose(_block_scores(w, mask), _np_best_scores(w),
                             rtol=1e-6)
  ref = np.asarray(REF(w))
  if kind == "int":   # exact sums: identical tie-breaking, bit for bit
    np.testing.assert_array_equal(np.asarray(mask), ref)
  else:               # real data: same optimum (an ulp-level near-tie may differ)
    np.testing.assert_allclose(_block_scores(w, mask), _block_scores(w, ref),
                               rtol=1e-6)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("shape", [(36, 40)])
def test_compressed_outputs(interpret, shape):
  w = _data(shape, "int", seed=1)
  mask, (v, m), (vt, mt) = tm._transposable(
      w, with_compressed=True, config=CFG, interpret=interpret, poison=True)
  r, k = shape
  assert v.shape == (r, k // 2) and m.shape == (r, c.meta_words(k))
  assert vt.shape == (k, r // 2) and mt.shape == (k, c.meta_words(r))
  want = REF_COMPRESSED(w)
  for got, ref in zip(jax.tree.leaves((mask, (v, m), (vt, mt))),
                      jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  masked = np.where(np.asarray(mask), np.asarray(w), 0)
  np.testing.assert_array_equal(np.asarray(DECOMP(v, m)), masked)
  np.testing.assert_array_equal(np.asarray(DECOMP(vt, mt)), masked.T)


@pytest.mark.parametrize("interpret", MODES)
def test_public_api_leading_axes(interpret):
  w = _data((2, 8, 16), "int", seed=2)
  mask = transposable_mask.transposable_mask24(w, interpret=interpret)
  assert mask.shape == w.shape
  np.testing.assert_array_equal(np.asarray(mask), np.asarray(REF(w)))


def test_bad_shapes_are_errors():
  with pytest.raises(ValueError, match="rows"):
    transposable_mask.transposable_mask24(jnp.ones((6, 8)), interpret=True)
  with pytest.raises(ValueError, match="columns"):
    transposable_mask.transposable_mask24(jnp.ones((8, 6)), interpret=True)
  with pytest.raises(ValueError, match="2-D"):
    transposable_mask.transposable_mask24(jnp.ones((2, 8, 8)), with_compressed=True,
                                interpret=True)
  with pytest.raises(ValueError, match="at least 2"):
    transposable_mask.transposable_mask24(jnp.ones((8,)), interpret=True)


def test_lowers_to_triton():
  w = jnp.ones((768, 3072), jnp.bfloat16)
  assert_lowers_to_triton(lambda w: transposable_mask.transposable_mask24(w), w,
                          expected_calls=1)
  assert_lowers_to_triton(
      lambda w: transposable_mask.transposable_mask24(w, with_compressed=True), w,
      expected_calls=1)
