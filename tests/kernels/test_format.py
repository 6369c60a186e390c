"""Tests of s24jax.kernels._common: the shared 2:4 metadata format (nibbles packed by hand),
decompression, block selection (hand-computed cases) and output poisoning (a kernel that
skips half its output)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from s24jax.kernels import _common as c
from s24jax.kernels._testing import MODES


def test_nibble_layout_by_hand():
  # Two rows of K = 36 (9 groups -> 2 words; the 2nd word holds 1 real group).
  idx = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (0, 1), (2, 3), (1, 3)]
  nib = np.array([[a | (b << 2) for a, b in idx]] * 2, np.uint32)
  meta = np.asarray(c.pack_meta_rows(jnp.asarray(nib)))
  assert meta.shape == (2, 2) and meta.dtype == np.uint32
  want0 = sum(int(nib[0, g]) << (4 * g) for g in range(8))
  want1 = int(nib[0, 8]) | sum(c.EMPTY_NIBBLE << (4 * s) for s in range(1, 8))
  assert int(meta[0, 0]) == want0 and int(meta[0, 1]) == want1
  back = np.asarray(c.unpack_nibbles(jnp.asarray(meta)))
  np.testing.assert_array_equal(back[:, :9], nib)
  assert (back[:, 9:] == c.EMPTY_NIBBLE).all()


def test_decompress_by_hand():
  # One group: keep positions 1 and 3 with values 5, 7.
  values = jnp.array([[5.0, 7.0]])
  meta = jnp.array([[1 | (3 << 2) | (c.EMPTY_WORD & ~0xF)]], jnp.uint32)
  np.testing.assert_array_equal(c.decompress(values, meta), [[0, 5, 0, 7]])
  with pytest.raises(ValueError, match="ceil"):
    c.decompress(values, jnp.zeros((1, 2), jnp.uint32))


@pytest.mark.parametrize("dim,pref,minimum,want", [
    (768, 256, 32, (256, 768)), (1600, 128, 64, (64, 1600)),
    (36, 256, 32, (64, 64)), (3, 16, 1, (1, 3)), (100, 64, 64, (64, 128)),
    (5, 16, 16, (16, 16))])
def test_fit_block(dim, pref, minimum, want):
  assert c.fit_block(dim, pref, minimum) == want


def test_fit_block_rejects_non_power_of_two():
  with pytest.raises(ValueError, match="power of two"):
    c.fit_block(96, 48)


@pytest.mark.parametrize("interpret", MODES)
def test_poison_catches_unwritten_elements(interpret):
  """A kernel that skips half its output leaves NaN / all-ones / True there."""
  def kernel(x_ref, f_ref, u_ref, b_ref):
    f_ref[:, pl.ds(0, 8)] = x_ref[:, pl.ds(0, 8)]
    u_ref[:, pl.ds(0, 8)] = jnp.zeros((8, 8), jnp.uint32)
    b_ref[:, pl.ds(0, 8)] = jnp.zeros((8, 8), jnp.bool_)

  x = jnp.ones((8, 16), jnp.float32)
  spec = pl.BlockSpec((8, 16), lambda i: (0, 0))
  f, u, b = c.pallas_call(
      kernel, out_shape=[jax.ShapeDtypeStruct((8, 16), d)
                         for d in (jnp.float32, jnp.uint32, jnp.bool_)],
      grid=(1,), in_specs=[spec], out_specs=[spec] * 3, num_warps=4,
      num_stages=1, interpret=interpret, poison=True)(x)
  assert np.isnan(np.asarray(f)[:, 8:]).all() and (np.asarray(f)[:, :8] == 1).all()
  assert (np.asarray(u)[:, 8:] == 0xFFFFFFFF).all()
  assert np.asarray(b)[:, 8:].all() and not np.asarray(b)[:, :8].any()


def test_triton_compiler_params_are_explicit():
  p = c.triton_params(4, 2)
  assert (p.num_warps, p.num_stages) == (4, 2)
