"""Tests for s24jax.kernels.masks: every mask (and S-STE's soft threshold) against an independent
numpy brute force or hand-computed cases, on CPU.

Brute forces are written without the library's tricks (no pairwise ranks, no pattern matmul,
no Gumbel), so agreement checks the maths and not a copy of the implementation.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import masks

# ----------------------------------------------------------------------------------------
# nm_mask
# ----------------------------------------------------------------------------------------


def _nm_mask_np(w: np.ndarray, n: int, m: int) -> np.ndarray:
  """Brute force: stable argsort of -|w| per group; the first n positions are kept."""
  g = np.abs(w).reshape(-1, m)                                   # (G, m)
  order = np.argsort(-g, axis=-1, kind="stable")                 # ties: lower index first
  keep = np.zeros_like(g, dtype=bool)
  np.put_along_axis(keep, order[:, :n], True, axis=-1)
  return keep.reshape(w.shape)


def test_nm_mask_hand_computed():
  w = jnp.array([[1.0, -5.0, 3.0, 2.0],        # keep -5, 3
                 [-1.0, -1.0, -1.0, -1.0],     # all tied: lowest two indices
                 [0.0, 2.0, 2.0, 2.0],         # tie among the top three: indices 1, 2
                 [4.0, 0.0, -4.0, 0.0]])       # |4| == |-4|, both kept
  want = np.array([[0, 1, 1, 0],
                   [1, 1, 0, 0],
                   [0, 1, 1, 0],
                   [1, 0, 1, 0]], bool)
  np.testing.assert_array_equal(masks.nm_mask(w), want)
  np.testing.assert_array_equal(jax.jit(masks.nm_mask)(w), want)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (3, 4), (2, 8), (4, 8), (1, 2), (5, 16)])
def test_nm_mask_matches_brute_force(n, m):
  rng = np.random.default_rng(n * 100 + m)
  shape = (3, 2, 4 * m)
  cont = rng.standard_normal(shape).astype(np.float32)
  ties = rng.integers(-2, 3, size=shape).astype(np.float32)    # many exact ties
  f = jax.jit(masks.nm_mask, static_argnums=(1, 2))
  for w in (cont, ties):
    got = np.asarray(f(jnp.asarray(w), n, m))
    assert got.dtype == bool and got.shape == shape
    assert (got.reshape(-1, m).sum(-1) == n).all()
    np.testing.assert_array_equal(got, _nm_mask_np(w, n, m))


def test_nm_mask_errors():
  with pytest.raises(ValueError, match=r"dimension 6 is not divisible by 4"):
    masks.nm_mask(jnp.ones((2, 6)))
  with pytest.raises(ValueError, match=r"n <= m"):
    masks.nm_mask(jnp.ones((2, 8)), 5, 4)


# ----------------------------------------------------------------------------------------
# soft_threshold24 (S-STE's soft threshold)
# ----------------------------------------------------------------------------------------


def _soft_threshold24_np(w: np.ndarray) -> np.ndarray:
  """Brute force, one group at a time: t = the second-smallest |w_i| of the group (a full
  sort), then sign(w_i) * max(|w_i| - t, 0) entry by entry."""
  w64 = np.asarray(w, np.float64)
  flat = w64.reshape(-1, 4)
  out = np.zeros_like(flat)
  for g in range(flat.shape[0]):
    t = sorted(abs(float(v)) for v in flat[g])[1]
    for i in range(4):
      v = float(flat[g, i])
      out[g, i] = (1.0 if v > 0 else -1.0 if v < 0 else 0.0) * max(abs(v) - t, 0.0)
  return out.reshape(w.shape)


def test_soft_threshold24_hand_computed():
  w = jnp.array([[1.0, -5.0, 3.0, 2.0],        # t = 2: [0, -3, 1, 0]
                 [-1.0, -1.0, -1.0, -1.0],     # all tied: t = 1, everything 0
                 [0.0, 2.0, -4.0, 0.5]])       # t = 0.5: [0, 1.5, -3.5, 0]
  want = np.array([[0, -3, 1, 0], [0, 0, 0, 0], [0, 1.5, -3.5, 0]], np.float32)
  np.testing.assert_array_equal(masks.soft_threshold24(w), want)
  np.testing.assert_array_equal(jax.jit(masks.soft_threshold24)(w), want)


@pytest.mark.parametrize("shape", [(8,), (3, 16), (2, 3, 12)])
def test_soft_threshold24_matches_brute_force(shape):
  rng = np.random.default_rng(sum(shape))
  cont = rng.standard_normal(shape).astype(np.float32)
  ties = rng.integers(-2, 3, size=shape).astype(np.float32)      # many exact ties and zeros
  f = jax.jit(masks.soft_threshold24)
  for w in (cont, ties):
    got = np.asarray(f(jnp.asarray(w)))
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_allclose(got, _soft_threshold24_np(w), rtol=1e-6, atol=1e-7)
    # At most two survivors per group (exactly two where the magnitudes are distinct), each
    # with w's sign and a smaller magnitude.
    nz = (got != 0).reshape(-1, 4).sum(-1)
    assert (nz <= 2).all()
    distinct = np.array([len(set(np.abs(g))) == 4 for g in w.reshape(-1, 4)])
    assert (nz[distinct] == 2).all()
    kept = got != 0
    assert (np.sign(got[kept]) == np.sign(w[kept])).all()
    assert (np.abs(got) <= np.abs(w)).all()


def test_soft_threshold24_is_continuous_where_the_hard_threshold_jumps():
  # Two magnitudes crossing (|w_1| passes |w_2|): nm_mask swaps the kept entry, S does not jump.
  eps = 1e-3
  below = jnp.array([4.0, 1.0 - eps, 1.0, 0.1])
  above = jnp.array([4.0, 1.0 + eps, 1.0, 0.1])
  assert (masks.nm_mask(below) != masks.nm_mask(above)).any()
  assert float(jnp.max(jnp.abs(masks.soft_threshold24(below) - masks.soft_threshold24(above)))
               ) <= 2 * eps + 1e-6


def test_soft_threshold24_dtype_and_errors():
  w = jax.random.normal(jax.random.key(0), (4, 8)).astype(jnp.bfloat16)
  got = masks.soft_threshold24(w)
  assert got.dtype == jnp.bfloat16 and got.shape == w.shape
  want = _soft_threshold24_np(np.asarray(w, np.float32))
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)
  with pytest.raises(ValueError, match=r"dimension 6 is not divisible by 4"):
    masks.soft_threshold24(jnp.ones((2, 6)))


def test_soft_threshold24_orders_nan_inf_and_zeros_as_a_sort_does():
  """t is the second smallest |w| in np.sort's order (NaN last); signed zeros kept; f32, bf16."""
  w = np.array([[np.nan, 1, -2, 3], [3, np.nan, np.nan, -1], [np.inf, -0.0, 2, 0.0],
                [-np.inf, np.inf, 1, np.nan], [-0.0, 0.0, -0.0, 5], [-2, 2, -2, 2]], np.float32)
  a, sign = np.abs(w), np.where(w == 0, w, np.sign(w))             # jnp.sign(-0.0) is -0.0
  with np.errstate(invalid="ignore"):
    want = sign * np.maximum(a - np.sort(a, axis=-1)[:, 1:2], 0)
  for dtype in (jnp.float32, jnp.bfloat16):
    got = np.asarray(jax.jit(masks.soft_threshold24)(jnp.asarray(w, dtype)), np.float32)
    np.testing.assert_array_equal(got, want)                       # NaN where NaN
    np.testing.assert_array_equal(np.signbit(got[got == 0]), np.signbit(want[want == 0]))


def test_flip_rate_hand_computed():
  old = jnp.array([[1, 1, 0, 0], [0, 1, 1, 0]], bool)
  new = jnp.array([[1, 0, 1, 0], [0, 1, 1, 0]], bool)   # 2 of 8 changed
  assert float(masks.flip_rate(new, old)) == pytest.approx(0.25)
  assert float(masks.flip_rate(old, old)) == 0.0
  assert float(jax.jit(masks.flip_rate)(~old, old)) == 1.0
  a = jnp.zeros((4, 8), bool).at[0, :3].set(True)      # 3 of 32 changed
  assert float(masks.flip_rate(a, jnp.zeros((4, 8), bool))) == pytest.approx(3 / 32)


# ----------------------------------------------------------------------------------------
# transposable_mask
# ----------------------------------------------------------------------------------------


def _doubly_24_patterns_np() -> np.ndarray:
  """All binary 4x4 matrices (2^16 of them) filtered to two ones per row and per column."""
  allm = np.array(list(itertools.product([0, 1], repeat=16)), np.int8).reshape(-1, 4, 4)
  ok = (allm.sum(1) == 2).all(1) & (allm.sum(2) == 2).all(1)
  return allm[ok]


def _transposable_np(w: np.ndarray):
  """Brute force over every pattern per 4x4 block; also returns the best-vs-second score gap."""
  pats = _doubly_24_patterns_np().astype(np.float64)            # (90, 4, 4)
  *lead, r, c = w.shape
  a = np.abs(w.astype(np.float64)).reshape(-1, r, c)
  out = np.zeros(a.shape, bool)
  gaps = []
  for b in range(a.shape[0]):
    for i in range(0, r, 4):
      for j in range(0, c, 4):
        blk = a[b, i:i + 4, j:j + 4]
        scores = (pats * blk).sum((1, 2))
        srt = np.sort(scores)
        gaps.append(srt[-1] - srt[-2])
        out[b, i:i + 4, j:j + 4] = pats[np.argmax(scores)] > 0
  return out.reshape(w.shape), np.array(gaps)


def test_transposable_patterns():
  p = masks.TRANSPOSABLE_PATTERNS
  assert p.shape == (90, 4, 4)
  assert (p.sum(1) == 2).all() and (p.sum(2) == 2).all()
  assert len({q.tobytes() for q in p}) == 90                    # all distinct
  ref = {q.tobytes() for q in _doubly_24_patterns_np()}
  assert {q.tobytes() for q in p} == ref                        # and the complete set


@pytest.mark.parametrize("shape", [(8, 8), (8, 16), (12, 4), (2, 8, 12)])
def test_transposable_mask_matches_brute_force(shape):
  rng = np.random.default_rng(sum(shape))
  w = rng.standard_normal(shape).astype(np.float32)
  got = np.asarray(jax.jit(masks.transposable_mask)(jnp.asarray(w)))
  want, gaps = _transposable_np(w)
  a = np.abs(w.astype(np.float64))
  # Same kept magnitude everywhere; same mask wherever the optimum is not a near-tie.
  np.testing.assert_allclose((a * got).sum(), (a * want).sum(), rtol=1e-6)
  bw = lambda x: np.swapaxes(x.reshape(*shape[:-2], shape[-2] // 4, 4, shape[-1] // 4, 4),
                             -3, -2).reshape(-1, 16)
  clear = gaps > 1e-5
  assert clear.mean() > 0.9
  np.testing.assert_array_equal(bw(got)[clear], bw(want)[clear])
  # 2:4 along both of the last two axes.
  assert (got.reshape(*shape[:-1], -1, 4).sum(-1) == 2).all()
  assert (np.swapaxes(got, -1, -2).reshape(*shape[:-2], shape[-1], -1, 4).sum(-1) == 2).all()


def test_transposable_mask_ties_and_dtype():
  # Every pattern ties on an all-equal block: the lowest index (pattern 0) wins.
  got = masks.transposable_mask(jnp.ones((4, 4), jnp.bfloat16))
  np.testing.assert_array_equal(got, masks.TRANSPOSABLE_PATTERNS[0] > 0)
  np.testing.assert_array_equal(masks.TRANSPOSABLE_PATTERNS[0],
                                [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]])
  # A block whose best pattern is unique: the mask picks exactly it.
  w = np.array([[9, 8, 0, 0], [0, 7, 6, 0], [0, 0, 5, 4], [3, 0, 0, 2]], np.float32)
  np.testing.assert_array_equal(masks.transposable_mask(jnp.asarray(-w)), w > 0)


def test_transposable_mask_errors():
  with pytest.raises(ValueError, match=r"rows R .*dimension 6 is not divisible by 4"):
    masks.transposable_mask(jnp.ones((6, 8)))
  with pytest.raises(ValueError, match=r"columns C .*dimension 10 is not divisible by 4"):
    masks.transposable_mask(jnp.ones((8, 10)))
  with pytest.raises(ValueError, match=r"at least 2 dimensions"):
    masks.transposable_mask(jnp.ones((8,)))


def test_transposable_kept_ratio():
  w = jax.random.normal(jax.random.key(0), (64, 256))
  r = float(jax.jit(masks.transposable_kept_ratio)(w))
  # Measured ~0.943 on N(0, 1) weights (768 x 3072); a loose sanity band around it.
  assert 0.9 < r <= 1.0
  assert float(masks.transposable_kept_ratio(jnp.zeros((4, 4)))) == 1.0
  # A matrix that is already doubly 2:4 loses nothing.
  d = jnp.asarray(np.tile(masks.TRANSPOSABLE_PATTERNS[7], (2, 3)), jnp.float32)
  assert float(masks.transposable_kept_ratio(d)) == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------
# mvue24
# ----------------------------------------------------------------------------------------


def _inclusion_np(x: np.ndarray) -> np.ndarray:
  """Enumerate the 12 ordered draws (i, j) of one group and add up their probabilities."""
  a = np.abs(x.astype(np.float64)) + masks.MVUE_REL_EPS * np.abs(x).max() + masks.MVUE_TINY
  s = a.sum()
  p = np.zeros(4)
  for i, j in itertools.permutations(range(4), 2):
    pr = a[i] / s * a[j] / (s - a[i])
    p[i] += pr
    p[j] += pr
  return p


def test_mvue24_inclusion_prob_hand_computed():
  np.testing.assert_allclose(masks.mvue24_inclusion_prob(jnp.ones(4)), 0.5, rtol=1e-6)
  np.testing.assert_allclose(masks.mvue24_inclusion_prob(jnp.array([3.0, 1, 0, 0])),
                             [1, 1, 0, 0], atol=1e-5)
  # x = [1, 2, 3, 4]: p_0 = .1 + .2/8 + .3/7 + .4/6.
  p = masks.mvue24_inclusion_prob(jnp.array([1.0, 2, 3, 4]))
  assert float(p[0]) == pytest.approx(0.1 + 0.2 / 8 + 0.3 / 7 + 0.4 / 6, rel=1e-5)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 4)) * rng.choice([0.0, 1.0, 1e-3], size=(5, 4))
  got = np.asarray(masks.mvue24_inclusion_prob(jnp.asarray(x, jnp.float32)))
  np.testing.assert_allclose(got, np.stack([_inclusion_np(g) for g in x]), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got.sum(-1), 2.0, rtol=1e-5)


def test_mvue24_hand_computed_and_support():
  key = jax.random.key(0)
  out = masks.mvue24(key, jnp.ones((3, 8)))
  # Every group keeps exactly two entries, each scaled by 1/p = 2.
  np.testing.assert_array_equal(np.sort(np.asarray(out).reshape(-1, 4), -1),
                                np.tile([0, 0, 2, 2], (6, 1)))
  # All-zero groups give zeros (no 0/0); groups with one non-zero keep it exactly (p = 1).
  z = masks.mvue24(key, jnp.array([0.0, 0, 0, 0, 0, -7, 0, 0]))
  np.testing.assert_allclose(z, [0, 0, 0, 0, 0, -7, 0, 0], rtol=1e-5)
  # Random inputs with zeros: at most 2 non-zeros per group; continuous ones: exactly 2.
  keys = jax.random.split(jax.random.key(1), 64)
  x = jax.random.normal(jax.random.key(2), (4, 16))
  xz = x * (jax.random.uniform(jax.random.key(3), x.shape) < 0.5)
  draw = jax.jit(jax.vmap(masks.mvue24, in_axes=(0, None)))
  assert ((np.asarray(draw(keys, xz)).reshape(64, -1, 4) != 0).sum(-1) <= 2).all()
  assert ((np.asarray(draw(keys, x)).reshape(64, -1, 4) != 0).sum(-1) == 2).all()


def test_mvue24_unbiased_and_variance():
  # Mixed magnitudes, signs, zeros and a single-non-zero group.
  x = jnp.array([[1.0, -2.0, 3.0, 0.5, 0.0, 0.0, 4.0, 0.0],
                 [0.1, 0.1, -0.1, 5.0, 1.0, 1.0, 1.0, 1.0]])
  n = 20000
  draws = jax.jit(jax.vmap(masks.mvue24, in_axes=(0, None)))(
      jax.random.split(jax.random.key(42), n), x)                # (n, 2, 8)
  d = np.asarray(draws, np.float64)
  xv = np.asarray(x, np.float64)
  p = np.asarray(masks.mvue24_inclusion_prob(x), np.float64)
  var = np.asarray(masks.mvue24_variance(x), np.float64)
  # atol: for p near 1 (the 5.0 entry) 1/p - 1 cancels, and float32's rounding of p (~6e-8)
  # is then ~2e-5 of it: ~x^2 * 6e-8 absolute.
  np.testing.assert_allclose(var, xv ** 2 * (1 / p - 1), rtol=1e-5, atol=4e-6)
  # Mean within 5 standard errors of x (exact SE from the exact variance).
  se = np.sqrt(var / n)
  assert (np.abs(d.mean(0) - xv) <= 5 * se + 1e-6).all(), (d.mean(0), xv, se)
  # Empirical variance within 5 SE of the formula; each entry is a two-point law
  # (x/p w.p. p, else 0), whose fourth central moment gives the SE of the sample variance.
  # The second term bounds the error from centring on the sample mean, (mean - x)^2, which
  # is all that is left for a symmetric two-point law (p = 1/2: mu4 = var^2).
  mu4 = p * (xv * (1 - p) / p) ** 4 + (1 - p) * xv ** 4
  se_var = np.sqrt(np.maximum(mu4 - var ** 2, 0) / n)
  tol = 5 * se_var + 25 * var / n + 1e-6
  assert (np.abs(d.var(0) - var) <= tol).all(), (d.var(0), var, se_var)
  # Empirical inclusion frequencies match p (entries with x != 0).
  nz = xv != 0
  freq = (d != 0).mean(0)
  assert (np.abs(freq - p)[nz] <= 5 * np.sqrt(p * (1 - p) / n)[nz] + 1e-6).all()


def test_mvue24_dtypes_and_errors():
  x = jax.random.normal(jax.random.key(0), (2, 3, 8)).astype(jnp.bfloat16)
  out = jax.jit(masks.mvue24)(jax.random.key(1), x)
  assert out.dtype == jnp.bfloat16 and out.shape == x.shape
  assert ((np.asarray(out, np.float32).reshape(-1, 4) != 0).sum(-1) <= 2).all()
  with pytest.raises(ValueError, match=r"dimension 6 is not divisible by 4"):
    masks.mvue24(jax.random.key(0), jnp.ones((2, 6)))


# ----------------------------------------------------------------------------------------
# venom_mask
# ----------------------------------------------------------------------------------------


def _venom_np(x: np.ndarray, v: int, n: int, m: int):
  """Brute force: every 4-subset of every v x m block, per-row top-n by full sort."""
  *lead, r, c = x.shape
  a = np.abs(x.astype(np.float64)).reshape(-1, r, c)
  out = np.zeros(a.shape, bool)
  subsets = list(itertools.combinations(range(m), 4))
  for b in range(a.shape[0]):
    for i in range(0, r, v):
      for j in range(0, c, m):
        blk = a[b, i:i + v, j:j + m]                               # (v, m)
        scores = [np.sort(blk[:, list(s)], axis=1)[:, 4 - n:].sum() for s in subsets]
        s = list(subsets[int(np.argmax(scores))])
        sub = blk[:, s]                                            # (v, 4)
        order = np.argsort(-sub, axis=1, kind="stable")[:, :n]
        for row in range(v):
          for k in order[row]:
            out[b, i + row, j + s[k]] = True
  return out.reshape(x.shape)


@pytest.mark.parametrize("shape,v,n,m", [
    ((8, 16), 4, 2, 8), ((4, 8), 2, 1, 8), ((2, 6, 12), 3, 2, 6),
    ((16, 8), 16, 3, 4), ((4, 10), 1, 2, 5), ((8, 8), 2, 4, 8)])
def test_venom_matches_brute_force(shape, v, n, m):
  rng = np.random.default_rng(v * 10 + n + m)
  x = rng.standard_normal(shape).astype(np.float32)
  select = jax.jit(masks.venom_select, static_argnums=(1, 2, 3))
  mask, cols = (np.asarray(t) for t in select(jnp.asarray(x), v, n, m))
  want = _venom_np(x, v, n, m)
  a = np.abs(x)
  np.testing.assert_allclose((a * mask).sum(), (a * want).sum(), rtol=1e-6)
  np.testing.assert_array_equal(mask, want)
  np.testing.assert_array_equal(
      mask, jax.jit(masks.venom_mask, static_argnums=(1, 2, 3))(jnp.asarray(x), v, n, m))
  *lead, r, c = shape
  assert cols.dtype == np.int32 and cols.shape == (*lead, r // v, c // m, 4)
  assert (np.diff(cols, axis=-1) > 0).all() and (cols >= 0).all() and (cols < m).all()
  # Structure: each row keeps n inside its block; all kept columns are the 4 chosen ones.
  blk = np.swapaxes(mask.reshape(*lead, r // v, v, c // m, m), -3, -2)   # (..., R/v, C/m, v, m)
  assert (blk.sum(-1) == n).all()
  chosen = (cols[..., :, None] == np.arange(m)).any(-2)                   # (..., R/v, C/m, m)
  assert not (blk & ~chosen[..., None, :]).any()
  assert mask.mean() == pytest.approx(n / m)


def test_venom_ties_and_errors():
  # All-equal block: lowest subset (columns 0..3), lowest n indices in each row.
  mask, cols = masks.venom_select(jnp.ones((2, 8)), 2, 2, 8)
  np.testing.assert_array_equal(cols, [[[0, 1, 2, 3]]])
  np.testing.assert_array_equal(mask, np.tile([1, 1, 0, 0, 0, 0, 0, 0], (2, 1)).astype(bool))
  with pytest.raises(ValueError, match=r"rows R .*dimension 6 is not divisible by 4"):
    masks.venom_mask(jnp.ones((6, 8)), 4, 2, 8)
  with pytest.raises(ValueError, match=r"columns C .*dimension 12 is not divisible by 8"):
    masks.venom_mask(jnp.ones((4, 12)), 4, 2, 8)
  with pytest.raises(ValueError, match=r"n <= 4"):
    masks.venom_mask(jnp.ones((4, 8)), 4, 5, 8)
  with pytest.raises(ValueError, match=r"m >= 4"):
    masks.venom_mask(jnp.ones((4, 3)), 4, 2, 3)
