"""Tests of s24jax.kernels.tcgen05: Blackwell 2:4 sparse GEMMs.

On CPU: the host-side metadata conversion (package nibbles -> tcgen05's formatted uint2
pairs) against NumPy, decoded straight from the dense matrix, on random and tied groups; the
padding; the error off a Blackwell GPU. The numerics need a Blackwell GPU (tests marked
`gpu`, skipped elsewhere): the same checks as the other kernels' tests, against the jnp
reference and the dense XLA products the `xla` backend computes.
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import mvue24
from s24jax.kernels import sparsify24
from s24jax.kernels import transposable_mask
from s24jax.kernels import _common as c
from s24jax.kernels import tcgen05 as tc
from s24jax.kernels._testing import np_decompress

COMPRESS = jax.jit(sparsify24.compress24_reference)


def _np_kept_pairs(w):
  """Brute force from the dense matrix: per group of four along the last axis, the kept
  positions (i0 < i1): the nonzeros, topped up with the lowest zero positions, i.e. the
  two largest |w| with ties to the lower index."""
  w = np.asarray(w, np.float32)
  m, k = w.shape
  out = np.zeros((m, k // 4, 2), np.int64)
  for r, g in itertools.product(range(m), range(k // 4)):
    grp = w[r, 4 * g:4 * g + 4]
    out[r, g] = sorted(sorted(range(4), key=lambda j: (-abs(grp[j]), j))[:2])
  return out


def _np_format(pairs):
  """tcgen05 metadata layout for 16-bit operands, index by index: entry e of row r of the
  (M, K/2) pair array (e = 2 * group + slot) goes to
  [r // 128, e // 64, a * 16 + f * 8 + c, d * 16 + b * 8 + g] with r % 128 = a * 16 + b * 8 + c
  and e % 64 = d * 16 + f * 8 + g (the layout format_tcgen05_sparse_metadata builds)."""
  p = np.asarray(pairs).reshape(pairs.shape[0], -1)      # (M, K/2)
  m, half = p.shape
  out = np.zeros((m // 128, half // 64, 128, 64), np.int64)
  for r, e in itertools.product(range(m), range(half)):
    a, b, cc = (r % 128) // 16, (r % 16) // 8, r % 8
    d, f, g = (e % 64) // 16, (e % 16) // 8, e % 8
    out[r // 128, e // 64, a * 16 + f * 8 + cc, d * 16 + b * 8 + g] = p[r, e]
  return out


def _np_unformat(fmt, m, k):
  """Inverse of _np_format: formatted (M/128, K/128, 128, 64) -> pairs (M, K/4, 2)."""
  fmt = np.asarray(fmt)
  pairs = np.zeros((m, k // 2), np.int64)
  for r, e in itertools.product(range(m), range(k // 2)):
    a, b, cc = (r % 128) // 16, (r % 16) // 8, r % 8
    d, f, g = (e % 64) // 16, (e % 16) // 8, e % 8
    pairs[r, e] = fmt[r // 128, e // 64, a * 16 + f * 8 + cc, d * 16 + b * 8 + g]
  return pairs.reshape(m, k // 4, 2)


def _weights(m, k, kind, seed=0):
  key = jax.random.key(seed)
  if kind == "random":
    return jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
  # Ties: small integers (many equal magnitudes), whole zero groups, all-equal groups.
  w = jax.random.randint(key, (m, k), -2, 3).astype(jnp.float32)
  w = w.at[::3, 8:12].set(0.0).at[1::3, 16:20].set(1.0)
  return w.astype(jnp.bfloat16)


@pytest.mark.parametrize("kind", ["random", "ties"])
def test_metadata_conversion_matches_numpy(kind):
  m, k = 128, 256
  w = _weights(m, k, kind)
  values, meta = COMPRESS(w)
  want_pairs = _np_kept_pairs(w)
  got_pairs = np.asarray(tc.metadata_pairs(meta, k))
  np.testing.assert_array_equal(got_pairs, want_pairs)
  fmt = tc.tcgen05_metadata(meta, k, jnp.bfloat16)
  assert fmt.shape == (m // 128, k // 128, 128, 64) and fmt.dtype == jnp.uint2
  fmt_np = np.asarray(fmt.astype(jnp.uint8))
  np.testing.assert_array_equal(fmt_np, _np_format(want_pairs))
  np.testing.assert_array_equal(_np_unformat(fmt_np, m, k), want_pairs)
  # The compressed values are the dense entries at those positions, in order.
  dense = np.asarray(w, np.float32)
  taken = np.take_along_axis(dense.reshape(m, k // 4, 4), want_pairs, axis=-1)
  np.testing.assert_array_equal(np.asarray(values, np.float32), taken.reshape(m, k // 2))


def test_padding_keeps_the_product():
  """M, K, N off the tiles: padded A decodes to the padded dense A (empty groups in the
  padding), B is zero-padded, so the padded product's [:M, :N] block is the product."""
  m, k, n = 130, 100, 70            # M > 128, K % 128 != 0 and K % 32 != 0, N > 64
  w = _weights(m, k, "ties", seed=3)
  values, meta = COMPRESS(w)
  b = jax.random.normal(jax.random.key(4), (n, k), jnp.bfloat16)
  pv, pb, fmt, cfg = tc.prepare_operands(values, meta, b, tc.Tcgen05Config())
  mp, kp, np_ = 256, 128, 128
  assert pv.shape == (mp, kp // 2) and pb.shape == (np_, kp) and cfg.tile_n == 128
  assert fmt.shape == (mp // 128, kp // 128, 128, 64)
  pairs = _np_unformat(np.asarray(fmt.astype(jnp.uint8)), mp, kp)
  dense = np.zeros((mp, kp), np.float32)
  pvals = np.asarray(pv, np.float32).reshape(mp, kp // 4, 2)
  for r, g, s in itertools.product(range(mp), range(kp // 4), range(2)):
    dense[r, 4 * g + pairs[r, g, s]] = pvals[r, g, s]
  np.testing.assert_array_equal(dense[:m, :k], np_decompress(values, meta))
  assert not dense[m:].any() and not dense[:, k:].any()
  assert (pairs[m:] == (0, 1)).all() and (pairs[:, k // 4:] == (0, 1)).all()
  np.testing.assert_array_equal(np.asarray(pb[:n, :k]), np.asarray(b))
  assert not np.asarray(pb[n:], np.float32).any()
  assert not np.asarray(pb[:, k:], np.float32).any()


def test_small_token_counts_take_the_64_tile():
  values, meta = COMPRESS(_weights(128, 128, "random"))
  b = jnp.ones((40, 128), jnp.bfloat16)
  _, pb, _, cfg = tc.prepare_operands(values, meta, b, tc.Tcgen05Config())
  assert cfg.tile_n == 64 and pb.shape == (64, 128)


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="checks the error off a GPU")
def test_off_blackwell_error_names_the_backend_that_runs():
  values, meta = COMPRESS(_weights(128, 128, "random"))
  x = jnp.ones((8, 128), jnp.bfloat16)
  for call in (lambda: tc.sparse_matmul(values, meta, x),
               lambda: tc.forward(x, values, meta),
               lambda: tc.data_grad(x, values, meta),
               lambda: tc.weight_grad(jnp.ones((8, 128), jnp.bfloat16), x, 0)):
    with pytest.raises(tc.NotBlackwellError, match="sparsity.backend='xla'"):
      call()


def test_bad_inputs_are_errors():
  values, meta = COMPRESS(_weights(128, 128, "random"))
  with pytest.raises(ValueError, match="K = 2"):
    tc.sparse_matmul(values, meta, jnp.ones((8, 64), jnp.bfloat16))
  with pytest.raises(ValueError, match="bf16 or both f16"):
    tc.sparse_matmul(values.astype(jnp.float32), meta, jnp.ones((8, 128), jnp.float32))
  with pytest.raises(ValueError, match="a_meta shape"):
    tc.sparse_matmul(values, meta[:, :1], jnp.ones((8, 128), jnp.bfloat16))
  with pytest.raises(ValueError, match="stages"):
    tc.Tcgen05Config(stages=1)


# ---------------------------------------------------------------------------------------------
# Numerics: Blackwell only (marked gpu; also skipped on other GPUs).


@pytest.mark.gpu
@pytest.mark.skipif(not tc.targets_blackwell(), reason="needs a Blackwell GPU")
@pytest.mark.parametrize("m,n,k", [(256, 128, 256), (130, 70, 100), (384, 16, 512)])
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_sparse_matmul_matches_reference(m, n, k, kind):
  w = _weights(m, k, kind)
  values, meta = COMPRESS(w)
  b = jax.random.normal(jax.random.key(1), (n, k), jnp.bfloat16)
  got = tc.sparse_matmul(values, meta, b, out_dtype=jnp.float32)
  want = np_decompress(values, meta) @ np.asarray(b, np.float32).T
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-2, atol=1e-2)
  ref = tc.reference(values, meta, b, out_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not tc.targets_blackwell(), reason="needs a Blackwell GPU")
def test_layer_gemms_match_the_xla_backend():
  """forward / data_grad / weight_grad against the dense products of the `xla` backend
  (s24jax/sparse_ops/xla.py: y = x W~^T, dX = dY W~, dW = MVUE(dY^T) x) on a transposable W~."""
  t, d_in, d_out = 256, 256, 384
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  w = jax.random.normal(kw, (d_out, d_in), jnp.bfloat16)
  mask, (v, m), (vt, mt) = transposable_mask.transposable_mask24(w, with_compressed=True)
  w_t = jnp.where(mask, w, 0).astype(jnp.float32)
  x = jax.random.normal(kx, (t, d_in), jnp.bfloat16)
  dy = jax.random.normal(kd, (t, d_out), jnp.bfloat16)
  f32 = lambda a: np.asarray(a, np.float32)   # noqa: E731
  np.testing.assert_allclose(f32(tc.forward(x, v, m)), f32(x) @ f32(w_t).T, rtol=2e-2,
                             atol=2e-1)
  np.testing.assert_allclose(f32(tc.data_grad(dy, vt, mt)), f32(dy) @ f32(w_t), rtol=2e-2,
                             atol=2e-1)
  # The weight gradient: the kernel's MVUE draws, decompressed, times x (the same estimate).
  seed = 7
  mv_values, mv_meta = mvue24.mvue24_compress(dy.T, seed)
  est = np_decompress(mv_values, mv_meta)                      # (out, T)
  np.testing.assert_allclose(f32(tc.weight_grad(dy, x, seed)), est @ f32(x), rtol=2e-2,
                             atol=2e-1)
