"""Tests of s24jax.kernels.mvue24: unbiased stochastic 2:4 with counter-based draws.

The kernel and the jnp reference share the hash and the per-group math, so
for the same seed the kept positions must agree exactly (values to f32
rounding); the estimator itself is checked statistically on the reference.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import mvue24
from s24jax.kernels import masks
from s24jax.kernels import _common as c
from s24jax.kernels import mvue24 as mv
from s24jax.kernels._testing import MODES
from s24jax.kernels._testing import assert_lowers_to_triton

CFG = mv.Mvue24Config()
REF = jax.jit(mv.mvue24_reference)


def _x(shape, dtype=jnp.float32, seed=0):
  x = jax.random.normal(jax.random.key(seed), shape, dtype)
  # Some exact zeros and an all-zero group (eps path).
  x = x.at[..., 0].set(0)
  return x.at[..., 4:8].set(0)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("shape,dtype", [((3, 36), jnp.bfloat16),
                                         ((2, 3, 100), jnp.float32)])
def test_same_draws_as_reference(interpret, shape, dtype):
  x = _x(shape, dtype)
  values, meta = mv._mvue24(x, 1234, config=CFG,
                            interpret=interpret, poison=True)
  rv, rm = REF(x, 1234)
  assert values.shape == rv.shape and values.dtype == dtype
  np.testing.assert_array_equal(np.asarray(meta), np.asarray(rm))
  # Same ops in the same order; a GPU may still round a division or fuse an
  # FMA differently from XLA, so values get a few-ulp allowance natively.
  tol = (1e-6 if interpret else 1e-5) if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(values, np.float32),
                             np.asarray(rv, np.float32), rtol=tol, atol=1e-7)
  # Valid positions (i0 < i1) everywhere, EMPTY in the padding nibbles.
  k = shape[-1]
  nib = np.asarray(c.unpack_nibbles(meta))
  real = nib[..., :k // 4]
  assert ((real & 3) < (real >> 2)).all()
  assert (nib[..., k // 4:] == c.EMPTY_NIBBLE).all()
  # Kept entries are x / p with p in (0, 1]: same sign, magnitude >= |x|.
  dense = np.asarray(c.decompress(values, meta), np.float32)
  xf = np.asarray(x, np.float32)
  kept = dense != 0
  assert (np.sign(dense[kept]) == np.sign(xf[kept])).all()
  assert (np.abs(dense[kept]) >= np.abs(xf[kept]) * (1 - 1e-2)).all()


@pytest.mark.parametrize("interpret", MODES)
def test_draws_do_not_depend_on_tiles_or_api(interpret):
  x = _x((8, 64), seed=1)
  small = mv.Mvue24Config(block_rows=2, block_cols=32)
  a = mvue24.mvue24_compress(x, 7, interpret=interpret, config=small)
  b = mvue24.mvue24_compress(x, 7, interpret=interpret)
  np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
  np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), rtol=1e-6)
  other = mvue24.mvue24_compress(x, 8, interpret=interpret)
  assert not np.array_equal(np.asarray(other[1]), np.asarray(b[1]))


def _np_inclusion(x):
  """The project's one rule: a_i = |x_i| + 1e-6 max_j |x_j| + tiny (masks.MVUE_REL_EPS)."""
  ax = np.abs(np.asarray(x, np.float64))
  a = ax + masks.MVUE_REL_EPS * ax.max() + masks.MVUE_TINY
  s = a.sum()
  return np.array([a[i] / s + sum(a[j] / s * a[i] / (s - a[j])
                                  for j in range(4) if j != i)
                   for i in range(4)])


def test_reference_is_unbiased_with_the_right_inclusion_probabilities():
  x = jnp.array([[1.0, -2.0, 0.5, 0.0, 3.0, 3.0, -0.1, 0.01,
                  1e-3, 5.0, -5.0, 2.0]])
  n = 100_000
  est = jax.jit(jax.vmap(lambda s: mv.mvue24_dense_reference(x, s)))(
      jnp.arange(n, dtype=jnp.uint32))[:, 0]
  est = np.asarray(est, np.float64)
  mean, se = est.mean(0), est.std(0) / np.sqrt(n)
  xf = np.asarray(x[0], np.float64)
  z = np.abs(mean - xf) / np.maximum(se, 1e-12)
  assert (z[xf != 0] < 5).all(), (mean, xf, z)
  assert (est[:, xf == 0] == 0).all()
  kept = (est != 0).mean(0)
  for g in range(3):
    p = _np_inclusion(xf[4 * g:4 * g + 4])
    nz = xf[4 * g:4 * g + 4] != 0
    np.testing.assert_allclose(kept[4 * g:4 * g + 4][nz], p[nz], atol=0.006)
  # Exactly two kept per group on every draw (zeros may be among them).
  counts = (np.abs(est.reshape(n, 3, 4)) > 0).sum(-1)
  assert counts.max() <= 2


def test_kernel_and_masks_follow_one_epsilon_rule():
  """Every kept value is x_i / p_i: its implied p_i must be masks.mvue24_inclusion_prob's (and
  the NumPy rule's), on random groups, tied groups, groups with zeros and tiny groups, where
  a different epsilon rule (absolute vs relative) would show."""
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.standard_normal(64), [1, 1, 1, 1, 2, 2, 0, 0, 1, 0, 0, 0],
                      1e-30 * rng.standard_normal(8), [3e-20, 0, 0, 1e-20]]).astype(np.float32)
  x = jnp.asarray(x.reshape(1, -1))
  want = np.asarray(masks.mvue24_inclusion_prob(x), np.float64)[0]
  np.testing.assert_allclose(
      want, np.concatenate([_np_inclusion(g) for g in np.asarray(x[0]).reshape(-1, 4)]),
      rtol=1e-5)
  for seed in range(4):
    dense = np.asarray(mv.mvue24_dense_reference(x, seed), np.float64)[0]
    xf = np.asarray(x[0], np.float64)
    kept = (dense != 0) & (xf != 0)
    np.testing.assert_allclose(xf[kept] / dense[kept], want[kept], rtol=1e-5)


def _masks_mvue24_np(x: np.ndarray, gumbel: np.ndarray) -> np.ndarray:
  """NumPy, group by group, from masks.mvue24's documented draws: keep the two largest
  log a_i + G_i (ties: lower index), as x_i / p_i (_np_inclusion); zeros elsewhere."""
  xg, gg = x.reshape(-1, 4), np.asarray(gumbel, np.float64).reshape(-1, 4)
  out = np.zeros(xg.shape)
  for g, (xs, gs) in enumerate(zip(xg, gg)):
    ax = np.abs(xs.astype(np.float64))
    z = np.log(ax + masks.MVUE_REL_EPS * ax.max() + masks.MVUE_TINY) + gs
    kept = np.argsort(-z, kind="stable")[:2]
    out[g, kept] = xs[kept] / _np_inclusion(xs)[kept]
  return out.reshape(x.shape)


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2 ** -8)])
def test_masks_mvue24_is_its_draws_kept_and_scaled(dtype, rtol):
  """masks.mvue24(key, x) against NumPy from jax.random.gumbel(key, (..., K/4, 4)) (the draws
  it documents): positions, values and the signs of zeros; x with zeros, -0.0, ties, an
  all-zero group, also as the backend passes it (dY^T, a transposed array)."""
  rng = np.random.default_rng(3)
  dy = rng.standard_normal((24, 8)) * rng.choice([0.0, 1.0, 1.0, 1e-3], (24, 8))
  dy[:4, 0], dy[4:8, 1], dy[8:12, 2] = 0.0, -0.0, [2, -2, 2, -2]
  dy = np.asarray(jnp.asarray(dy, dtype))                             # exactly representable
  for seed, transposed in ((0, True), (1, True), (2, False)):
    key = jax.random.key(seed)
    x = jnp.asarray(dy).T if transposed else jnp.asarray(dy.T.copy())   # (8, 24)
    got = np.asarray(jax.jit(masks.mvue24)(key, x), np.float32)
    gumbel = jax.random.gumbel(key, (8, 6, 4), jnp.float32)
    want = _masks_mvue24_np(dy.T.astype(np.float32), gumbel)
    np.testing.assert_array_equal(got != 0, want != 0)
    np.testing.assert_allclose(got, want, rtol=rtol)
    np.testing.assert_array_equal(np.signbit(got[got == 0]), np.signbit(want[want == 0]))


def test_uniforms_are_uniform():
  u = np.asarray(mv._uniform(mv.seed_hash(3), jnp.arange(200_000,
                                                        dtype=jnp.uint32)))
  assert u.min() >= 0 and u.max() < 1
  hist = np.histogram(u, bins=20, range=(0, 1))[0]
  assert np.abs(hist / 10_000 - 1).max() < 0.05
  assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01


def test_seed_from_key_and_errors():
  s = mvue24.seed_from_key(jax.random.key(0))
  assert s.dtype == jnp.uint32 and s.shape == ()
  with pytest.raises(ValueError, match="multiple of 4"):
    mvue24.mvue24_compress(jnp.ones((2, 6)), 0, interpret=True)
  with pytest.raises(ValueError, match="floating"):
    mvue24.mvue24_compress(jnp.ones((2, 8), jnp.int32), 0, interpret=True)


def test_lowers_to_triton():
  x = jnp.ones((768, 1024), jnp.bfloat16)
  assert_lowers_to_triton(lambda x, s: mvue24.mvue24_compress(x, s), x,
                          jnp.uint32(5), expected_calls=1)
