"""Transposable 2:4 mask (2:4 along rows *and* columns) by 90-pattern scoring.

Why: dX = dY W~ contracts W~ along its *out* axis, so a 2:4-accelerated
backward needs W~^T to be 2:4 too. The algorithm (docs/algorithms.md,
"Transposable 2:4 mask"; `s24jax.masks.transposable_mask` is its reference
implementation): for every 4x4 block B of |W| pick, among the 90 binary 4x4
patterns with exactly two ones in every row and every column, the pattern P
maximising sum(P * B); ties go to the lowest pattern index in the order of
`s24jax.masks.TRANSPOSABLE_PATTERNS`, which this kernel uses as is.

How the kernel scores: it loads the 16 block positions as 16 strided
[BR/4, BC/4] slices (one per (r, c) of the block), stacks them into a
[blocks, 16] matrix (pairwise `jnp.stack`, which the Triton backend lowers to
`tt.join`; the resulting column order is the bit-reversal of 4r + c, matched
by permuting the rows of the pattern matrix on the host), and then does what
the reference does: one [blocks, 16] x [16, 128] matmul (90 patterns padded
to a power of two with zero columns, f32, HIGHEST precision) and an argmax
(first maximum, so ties go to the lower pattern index; a zero pad column can
only tie, never win). The winner's 16-bit code (bit 4r + c) is read with a
one-hot max-reduction, and the mask bits are shifted out of it.
Both sum in f32 but maybe in different orders, so on real-valued data an
ulp-level near-tie may resolve differently; on data whose sums are exact
(integers) the two agree bit for bit (the tests check both).

Optionally the kernel also emits W~ and W~^T compressed (values + metadata in
the `kernels/_common.py` format), so the forward (`sparse24_matmul(x, v, m)`)
and the backward dX (`sparse24_matmul(dy, v_t, m_t)`) both read a compressed
operand without a second pass over W.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kernels import _common as c
from kernels.sparsify24 import compress24_reference
from s24jax import masks

# [90, 16] 0/1 matrix, entry 4r + c set when pattern p keeps (r, c); the
# pattern order (it decides ties) is the reference's.
PATTERN_MATRIX = masks.TRANSPOSABLE_PATTERNS.reshape(-1, 16).astype(np.float32)
# 16-bit code per pattern: bit 4r + c.
PATTERN_CODES = tuple(
    int(sum(1 << i for i in range(16) if PATTERN_MATRIX[p, i]))
    for p in range(len(PATTERN_MATRIX)))


@dataclasses.dataclass(frozen=True)
class TransposableMaskConfig(c.BlockConfig):
  """Tile of W per program (powers of two, multiples of 4; >= 32 on the
  axes that carry compressed metadata when with_compressed=True). The tile
  holds (block_rows/4) * (block_cols/4) 4x4 blocks, the M of the scoring
  matmul: >= 16 on GPU, and its [blocks, 128] f32 scores live in registers,
  so 32 x 32 (64 blocks) is a moderate default."""
  block_rows: int = 32
  block_cols: int = 32

  def __post_init__(self):
    super().__post_init__()
    if self.block_rows < 4 or self.block_cols < 4:
      raise ValueError("blocks must hold at least one 4x4 block.")


_NUM_PADDED = 128   # 90 patterns padded to a power of two


def _bitrev4(i: int) -> int:
  return int(f"{i:04b}"[::-1], 2)


def _kernel_tables():
  """(pattern matrix [16, 128] f32 with rows in stacked-column order,
  codes [1, 128] int32); pad columns are zero with pattern 0's code."""
  n = len(PATTERN_CODES)
  pm = np.zeros((16, _NUM_PADDED), np.float32)
  for i in range(16):
    pm[_bitrev4(i), :n] = PATTERN_MATRIX[:, i]
  codes = np.full((1, _NUM_PADDED), PATTERN_CODES[0], np.int32)
  codes[0, :n] = PATTERN_CODES
  return pm, codes


def _stack16(parts):
  """16 arrays [..] -> [.., 16] by pairwise stacking (tt.join on Triton).

  Column j of the result holds parts[_bitrev4(j)].
  """
  level = [jnp.stack([parts[2 * i], parts[2 * i + 1]], axis=-1)
           for i in range(8)]
  while len(level) > 1:
    nxt = []
    for i in range(len(level) // 2):
      s = jnp.stack([level[2 * i], level[2 * i + 1]], axis=-1)
      nxt.append(s.reshape(*s.shape[:-2], s.shape[-2] * 2))
    level = nxt
  return level[0]


def _best_pattern_code(mags, pm_ref, codes_ref):
  """mags[r][c] [gr, gc] -> int32 code (bit 4r + c) of the best pattern."""
  gr, gc = mags[0][0].shape
  a = _stack16([mags[r][col] for r in range(4) for col in range(4)])
  a = a.reshape(gr * gc, 16)
  scores = jnp.dot(a, pm_ref[...], precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)      # [blocks, 128]
  best = jnp.argmax(scores, axis=1).astype(jnp.int32)      # first max
  onehot = lax.broadcasted_iota(jnp.int32, scores.shape, 1) == best[:, None]
  code = jnp.max(jnp.where(onehot, codes_ref[...], 0), axis=1)
  return code.reshape(gr, gc)


def _transposable_kernel(w_ref, pm_ref, codes_ref, *out_refs, br, bc, rows,
                         cols, with_compressed):
  gr, gc = br // 4, bc // 4
  a = [[w_ref[pl.ds(r, gr, stride=4), pl.ds(col, gc, stride=4)]
        for col in range(4)] for r in range(4)]
  mags = [[jnp.abs(x.astype(jnp.float32)) for x in row] for row in a]
  code = _best_pattern_code(mags, pm_ref, codes_ref)
  bits = [[((code >> (4 * r + col)) & 1) == 1 for col in range(4)]
          for r in range(4)]
  mask_ref = out_refs[0]
  for r in range(4):
    for col in range(4):
      mask_ref[pl.ds(r, gr, stride=4), pl.ds(col, gc, stride=4)] = bits[r][col]
  if not with_compressed:
    return
  values_ref, meta_ref, values_t_ref, meta_t_ref = out_refs[1:]
  empty = jnp.uint32(c.EMPTY_NIBBLE)
  # Global 4x4-block coordinates, to write EMPTY into padding groups.
  blk_r = pl.program_id(0) * gr + lax.broadcasted_iota(jnp.int32, (gr, gc), 0)
  blk_c = pl.program_id(1) * gc + lax.broadcasted_iota(jnp.int32, (gr, gc), 1)
  # W~ rows: group = (row 4R + r, block column C), positions = columns.
  for r in range(4):
    i0, i1, v0, v1 = c.slots_from_selection(bits[r], a[r])
    nib = jnp.where(blk_c < cols // 4, c.nibble(i0, i1), empty)
    values_ref[pl.ds(r, gr, stride=4), pl.ds(0, gc, stride=2)] = v0
    values_ref[pl.ds(r, gr, stride=4), pl.ds(1, gc, stride=2)] = v1
    meta_ref[pl.ds(r, gr, stride=4), :] = c.pack_nibbles(nib)
  # W~^T rows: group = (column 4C + col, block row R), positions = rows.
  for col in range(4):
    sel = [bits[r][col] for r in range(4)]
    i0, i1, v0, v1 = c.slots_from_selection(sel, [a[r][col] for r in range(4)])
    nib = jnp.where(blk_r < rows // 4, c.nibble(i0, i1), empty)
    values_t_ref[pl.ds(col, gc, stride=4), pl.ds(0, gr, stride=2)] = v0.T
    values_t_ref[pl.ds(col, gc, stride=4), pl.ds(1, gr, stride=2)] = v1.T
    meta_t_ref[pl.ds(col, gc, stride=4), :] = c.pack_nibbles(nib.T)


@functools.partial(jax.jit, static_argnames=("with_compressed", "config",
                                             "interpret", "poison"))
def _transposable(w, *, with_compressed, config, interpret, poison=False):
  r, k = w.shape
  # >= 16 per axis keeps the scoring matmul at M >= 16 blocks (MMA minimum).
  minimum = c.COLS_PER_WORD if with_compressed else 16
  bc, kp = c.fit_block(k, max(config.block_cols, minimum), minimum=minimum)
  br, rp = c.fit_block(r, max(config.block_rows, minimum), minimum=minimum)
  wp = c.pad_axis(c.pad_axis(w, 1, kp), 0, rp)
  out_shape = [jax.ShapeDtypeStruct((rp, kp), jnp.bool_)]
  out_specs = [pl.BlockSpec((br, bc), lambda i, j: (i, j))]
  if with_compressed:
    out_shape += [
        jax.ShapeDtypeStruct((rp, kp // 2), w.dtype),
        jax.ShapeDtypeStruct((rp, kp // c.COLS_PER_WORD), jnp.uint32),
        jax.ShapeDtypeStruct((kp, rp // 2), w.dtype),
        jax.ShapeDtypeStruct((kp, rp // c.COLS_PER_WORD), jnp.uint32)]
    out_specs += [
        pl.BlockSpec((br, bc // 2), lambda i, j: (i, j)),
        pl.BlockSpec((br, bc // c.COLS_PER_WORD), lambda i, j: (i, j)),
        pl.BlockSpec((bc, br // 2), lambda i, j: (j, i)),
        pl.BlockSpec((bc, br // c.COLS_PER_WORD), lambda i, j: (j, i))]
  pm, codes = _kernel_tables()
  outs = c.pallas_call(
      functools.partial(_transposable_kernel, br=br, bc=bc, rows=r, cols=k,
                        with_compressed=with_compressed),
      out_shape=out_shape, grid=(rp // br, kp // bc),
      in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j)),
                pl.BlockSpec(pm.shape, lambda i, j: (0, 0)),
                pl.BlockSpec(codes.shape, lambda i, j: (0, 0))],
      out_specs=out_specs, num_warps=config.num_warps,
      num_stages=config.num_stages, interpret=interpret, poison=poison,
      name="transposable_mask24",
  )(wp, jnp.asarray(pm), jnp.asarray(codes))
  mask = outs[0][:r, :k]
  if not with_compressed:
    return mask
  values, meta, values_t, meta_t = outs[1:]
  return (mask,
          (values[:r, :k // 2], meta[:r, :c.meta_words(k)]),
          (values_t[:k, :r // 2], meta_t[:k, :c.meta_words(r)]))


def _check(w, two_d):
  if w.ndim < 2:
    raise ValueError(f"w must have at least 2 axes; got shape {w.shape}.")
  if two_d and w.ndim != 2:
    raise ValueError("with_compressed=True needs a 2-D w; got shape "
                     f"{w.shape}.")
  for name, d in (("rows (axis -2)", w.shape[-2]),
                  ("columns (axis -1)", w.shape[-1])):
    if d % 4:
      raise ValueError(f"transposable 2:4 needs the {name} to be a multiple "
                       f"of 4; got {d}.")


def transposable_mask24(w: jax.Array, *, with_compressed: bool = False,
                        interpret: bool = False,
                        config: TransposableMaskConfig | None = None):
  """Transposable 2:4 mask of w [..., R, C] (R, C multiples of 4).

  Returns the bool mask; with `with_compressed=True` (2-D w only) returns
  (mask, (values, meta), (values_t, meta_t)) where (values, meta) compress
  mask * w along C and (values_t, meta_t) compress (mask * w)^T along R.
  """
  _check(w, with_compressed)
  config = config or TransposableMaskConfig()
  if with_compressed:
    return _transposable(w, with_compressed=True, config=config,
                         interpret=interpret)
  # 4x4 blocks never straddle matrices when R % 4 == 0, so leading axes can
  # be folded into the rows.
  m = _transposable(w.reshape(-1, w.shape[-1]), with_compressed=False,
                    config=config, interpret=interpret)
  return m.reshape(w.shape)


def transposable_mask_reference(w: jax.Array) -> jax.Array:
  """The reference: `s24jax.masks.transposable_mask` (scores, argmax)."""
  return masks.transposable_mask(w)


def transposable_compressed_reference(w: jax.Array):
  """(mask, (values, meta), (values_t, meta_t)) in plain jnp."""
  mask = transposable_mask_reference(w)
  return (mask, compress24_reference(w, mask),
          compress24_reference(w.T, mask.T))
