"""kernels/cusparselt/layout.py: s24jax's writing of cuSPARSELt's compressed 2:4 operand, against
thread-by-thread emulations of the public descriptions (cusparselt_layout_emulation.py) and a
NumPy brute force of the values; round trips for every type. The library's own bytes are
compared on a GPU only (the `gpu` test at the end)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import masks
from s24jax.kernels.cusparselt import layout

import cusparselt_layout_emulation as emulation

PAIRS = list(itertools.combinations(range(4), 2))      # the six valid (i0, i1)
VALID_NIBBLES = {i0 | (i1 << 2) for i0, i1 in PAIRS}
DTYPES_16 = (jnp.bfloat16, jnp.float16)
DTYPES_8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def _random_nibbles(rng, m, k):
  choice = rng.integers(0, len(PAIRS), (m, k // 4))
  return np.array([i0 | (i1 << 2) for i0, i1 in PAIRS], np.uint8)[choice]


@pytest.mark.parametrize("lay,emulate,shapes", [
    (layout.SM80_16BIT, emulation.pytorch_sm80, [(128, 64), (256, 128), (384, 192)]),
    (layout.SM90_16BIT, emulation.torchao_sm90, [(64, 64), (128, 128), (192, 320)]),
    (layout.SM90_8BIT, emulation.torchao_cutlass8, [(64, 128), (128, 384)]),
], ids=lambda v: getattr(v, "name", None) or getattr(v, "__name__", "shapes"))
def test_metadata_order_is_the_described_kernels(lay, emulate, shapes):
  """Every metadata byte where the described GPU kernel, emulated lane by lane, writes it (random
  nibbles, so each byte's two nibbles and its place are checked; shapes of several tiles, not
  powers of two)."""
  rng = np.random.default_rng(0)
  for m, k in shapes:
    nib = _random_nibbles(rng, m, k)
    got = np.asarray(layout.metadata(jnp.asarray(nib), lay))
    np.testing.assert_array_equal(got, emulate(nib), err_msg=f"{lay.name} ({m}, {k})")
    np.testing.assert_array_equal(np.asarray(layout.nibbles(jnp.asarray(got), m, k, lay)), nib)


def _two_of_four(rng, m, k, dtype, zeros=0.0):
  """op(A) (m, k) with exactly two entries kept per group (of which a fraction `zeros` are
  then zeroed, making groups of fewer non-zeros)."""
  x = rng.standard_normal((m, k)).astype(np.float32) + 0.1 * np.sign(rng.standard_normal((m, k)))
  keep = np.asarray(masks.nm_mask(jnp.asarray(rng.standard_normal((m, k)))))
  x = np.where(keep & (rng.random((m, k)) >= zeros), x, 0)
  return np.asarray(jnp.asarray(x).astype(dtype))


def _brute_force_values(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per group: the kept positions (non-zeros first, then the lowest zeros), the values."""
  m, k = a.shape
  vals = np.zeros((m, k // 2), a.dtype)
  nib = np.zeros((m, k // 4), np.uint8)
  for i in range(m):
    for g in range(k // 4):
      grp = a[i, 4 * g:4 * g + 4]
      order = sorted(range(4), key=lambda j: (grp[j] == 0, j))
      i0, i1 = sorted(order[:2])
      vals[i, 2 * g:2 * g + 2] = grp[i0], grp[i1]
      nib[i, g] = i0 | (i1 << 2)
  return vals, nib


@pytest.mark.parametrize("lay,dtype", [(layout.SM80_16BIT, d) for d in DTYPES_16]
                         + [(layout.SM90_16BIT, d) for d in DTYPES_16]
                         + [(layout.SM90_8BIT, d) for d in DTYPES_8])
@pytest.mark.parametrize("zeros", [0.0, 0.4])
def test_compress_is_values_then_metadata_and_round_trips(lay, dtype, zeros):
  """The buffer is the kept values (row-major, in order) then the metadata, exactly as a brute
  force computes them, of the size rules.py allows; decompressing gives op(A) back, also for
  groups of fewer than two non-zeros (zeros = 0.4), whose positions are still valid pairs."""
  m, k = lay.row_multiple * 2, lay.col_multiple * 2
  a = _two_of_four(np.random.default_rng(1), m, k, dtype, zeros)
  buf = np.asarray(jax.jit(lambda x: layout.compress(x, lay))(a))
  itemsize = np.dtype(a.dtype).itemsize
  assert buf.dtype == np.uint8 and buf.shape == (m * k * itemsize // 2 + m * k // 8,)
  vals, nib = _brute_force_values(a)
  np.testing.assert_array_equal(buf[:m * k * itemsize // 2], vals.view(np.uint8).reshape(-1))
  meta = buf[m * k * itemsize // 2:]
  np.testing.assert_array_equal(meta, np.asarray(layout.metadata(jnp.asarray(nib), lay)))
  assert set(np.unique(meta & 15)) | set(np.unique(meta >> 4)) <= VALID_NIBBLES
  back = np.asarray(layout.decompress(jnp.asarray(buf), m, k, dtype, lay))
  # As numbers: a -0.0 (an FP8 underflow) comes back as the 0.0 of a dropped position.
  np.testing.assert_array_equal(back.astype(np.float32), a.astype(np.float32))


def test_natural_layout_round_trips_any_group_count():
  a = _two_of_four(np.random.default_rng(2), 24, 40, jnp.bfloat16)
  buf = layout.compress(jnp.asarray(a), layout.NATURAL)
  back = layout.decompress(buf, 24, 40, jnp.bfloat16, layout.NATURAL)
  np.testing.assert_array_equal(np.asarray(back).view(np.uint16), a.view(np.uint16))


def test_which_layout_each_gpu_and_shape_gets():
  assert layout.for_target((8, 0), 2, 3072, 768) is layout.SM80_16BIT
  assert layout.for_target((8, 6), 2, 256, 128) is layout.SM80_16BIT
  assert layout.for_target((9, 0), 2, 768, 3072) is layout.SM90_16BIT
  assert layout.for_target((9, 0), 1, 3072, 65536) is layout.SM90_8BIT
  # Off the tiles, another generation, FP8 without a description, no GPU: the library's.
  assert layout.for_target((9, 0), 2, 96, 768) is None
  assert layout.for_target((8, 0), 2, 3072, 96) is None
  assert layout.for_target((10, 0), 2, 768, 768) is None
  assert layout.for_target((8, 9), 1, 768, 768) is None
  assert layout.for_target(None, 2, 768, 768) is None


def test_wrong_shape_or_type_is_refused_naming_the_layout():
  with pytest.raises(ValueError, match="sm90_16bit.*multiple of 64"):
    layout.compress(jnp.zeros((96, 64), jnp.bfloat16), layout.SM90_16BIT)
  with pytest.raises(ValueError, match="sm90_8bit is for 1-byte"):
    layout.compress(jnp.zeros((64, 128), jnp.bfloat16), layout.SM90_8BIT)
  with pytest.raises(ValueError, match="bytes, not"):
    layout.decompress(jnp.zeros((7,), jnp.uint8), 64, 64, jnp.bfloat16, layout.SM90_16BIT)


def test_a_group_of_more_than_two_nonzeros_keeps_its_two_lowest_indexed():
  """Not 2:4 (3 or 4 non-zeros in a group): the two lowest-indexed non-zeros are kept (module
  docstring of layout.py), checked against the brute force's rule."""
  rng = np.random.default_rng(5)
  a = (1.0 + rng.random((64, 64))).astype(np.float32)
  a[:, 1::4] *= rng.random((64, 16)) < 0.5                      # some groups of 3, some of 4
  a = np.asarray(jnp.asarray(a).astype(jnp.bfloat16))
  buf = np.asarray(layout.compress(jnp.asarray(a), layout.SM90_16BIT))
  vals, nib = _brute_force_values(a)
  np.testing.assert_array_equal(buf[:64 * 32 * 2], vals.view(np.uint8).reshape(-1))
  np.testing.assert_array_equal(buf[64 * 32 * 2:],
                                np.asarray(layout.metadata(jnp.asarray(nib), layout.SM90_16BIT)))
  back = np.asarray(layout.decompress(jnp.asarray(buf), 64, 64, jnp.bfloat16,
                                      layout.SM90_16BIT), np.float32)
  kept = (np.cumsum(a.reshape(64, 16, 4) != 0, -1) <= 2).reshape(64, 64)
  np.testing.assert_array_equal(back, np.where(kept, a.astype(np.float32), 0))
