"""Transposable 2:4 mask (2:4 along rows *and* columns) by 90-pattern scoring.

Why: dX = dY W~ contracts W~ along its *out* axis, so a 2:4-accelerated
backward needs W~^T to be 2:4 too. The algorithm (docs/algorithms.md,
"Transposable 2:4 mask"; `s24jax.kernels.masks.transposable_mask` is its reference
implementation): for every 4x4 block B of |W| pick, among the 90 binary 4x4
patterns with exactly two ones in every row and every column, the pattern P
maximising sum(P * B); ties go to the lowest pattern index in the order of
`s24jax.kernels.masks.TRANSPOSABLE_PATTERNS`, which this kernel uses as is.

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
import itertools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from . import _common as c
from .sparsify24 import compress24_reference
from . import masks
from . import bench_harness

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


# The pair of kept columns of every row of every pattern, as an index into
# _PAIRS (itertools.combinations order): _ROW_PAIRS[p][r].
_PAIRS = tuple(itertools.combinations(range(4), 2))
_ROW_PAIRS = tuple(
    tuple(_PAIRS.index(tuple(int(c) for c in np.flatnonzero(row)))
          for row in pattern)
    for pattern in masks.TRANSPOSABLE_PATTERNS)


def _best_pattern_code(mags):
  """mags[r][c] [gr, gc] f32 -> int32 code (bit 4r + c) of the best pattern.

  score(p) = sum over rows r of the pair sum |w[r, c1]| + |w[r, c2]| of the
  pair row r keeps in pattern p: 24 pair sums, then 3 adds per pattern, and a
  running first maximum over the patterns in the reference's order (strict >,
  so ties go to the lower pattern index, as argmax does). Elementwise on
  [gr, gc] arrays only: no [blocks, 90] score matrix in registers.
  """
  pair = [[mags[r][i] + mags[r][j] for (i, j) in _PAIRS] for r in range(4)]
  best = code = None
  for p, rp in enumerate(_ROW_PAIRS):
    score = ((pair[0][rp[0]] + pair[1][rp[1]]) + pair[2][rp[2]]) + pair[3][rp[3]]
    if best is None:
      best = score
      code = jnp.full(score.shape, PATTERN_CODES[p], jnp.int32)
    else:
      better = score > best
      best = jnp.where(better, score, best)
      code = jnp.where(better, PATTERN_CODES[p], code)
  return code


def _transposable_kernel(w_ref, *out_refs, br, bc, rows,
                         cols, with_compressed):
  gr, gc = br // 4, bc // 4
  a = [[w_ref[pl.ds(r, gr, stride=4), pl.ds(col, gc, stride=4)]
        for col in range(4)] for r in range(4)]
  mags = [[jnp.abs(x.astype(jnp.float32)) for x in row] for row in a]
  code = _best_pattern_code(mags)
  bits = [[((code >> (4 * r + col)) & 1) == 1 for col in range(4)]
          for r in range(4)]
  mask_ref = out_refs[0]
  for r in range(4):
    for col in range(4):
      mask_ref[pl.ds(r, gr, stride=4), pl.ds(col, gc, stride=4)] = bits[r][col]
  if not with_compressed:
    return
  values_ref, meta_ref, values_tt_ref, meta_tt_ref = out_refs[1:]
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
  # Written transposed, as (W~^T values)^T [2R + s, 4C + col] and (meta_t)^T
  # [R // 8, 4C + col] (the caller transposes them back): no in-register
  # transpose, whose layout conversions made Triton rematerialize the
  # pattern search and spill (or run out of memory compiling).
  for col in range(4):
    sel = [bits[r][col] for r in range(4)]
    i0, i1, v0, v1 = c.slots_from_selection(sel, [a[r][col] for r in range(4)])
    nib = jnp.where(blk_r < rows // 4, c.nibble(i0, i1), empty)
    values_tt_ref[pl.ds(0, gr, stride=2), pl.ds(col, gc, stride=4)] = v0
    values_tt_ref[pl.ds(1, gr, stride=2), pl.ds(col, gc, stride=4)] = v1
    meta_tt_ref[:, pl.ds(col, gc, stride=4)] = c.pack_nibbles_along_rows(nib)


@functools.partial(jax.jit, static_argnames=("with_compressed", "config",
                                             "interpret", "poison"))
def _transposable(w, *, with_compressed, config, interpret, poison=False):
  r, k = w.shape
  # >= 16 per axis: at least 4 x 4 blocks per program.
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
        jax.ShapeDtypeStruct((rp // 2, kp), w.dtype),
        jax.ShapeDtypeStruct((rp // c.COLS_PER_WORD, kp), jnp.uint32)]
    out_specs += [
        pl.BlockSpec((br, bc // 2), lambda i, j: (i, j)),
        pl.BlockSpec((br, bc // c.COLS_PER_WORD), lambda i, j: (i, j)),
        pl.BlockSpec((br // 2, bc), lambda i, j: (i, j)),
        pl.BlockSpec((br // c.COLS_PER_WORD, bc), lambda i, j: (i, j))]
  outs = c.pallas_call(
      functools.partial(_transposable_kernel, br=br, bc=bc, rows=r, cols=k,
                        with_compressed=with_compressed),
      out_shape=out_shape, grid=(rp // br, kp // bc),
      in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
      out_specs=out_specs, num_warps=config.num_warps,
      num_stages=config.num_stages, interpret=interpret, poison=poison,
      name="transposable_mask24",
  )(wp)
  mask = outs[0][:r, :k]
  if not with_compressed:
    return mask
  values, meta, values_tt, meta_tt = outs[1:]
  return (mask,
          (values[:r, :k // 2], meta[:r, :c.meta_words(k)]),
          (values_tt.T[:k, :r // 2], meta_tt.T[:k, :c.meta_words(r)]))


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
  """The reference: `s24jax.kernels.masks.transposable_mask` (scores, argmax)."""
  return masks.transposable_mask(w)


def transposable_compressed_reference(w: jax.Array):
  """(mask, (values, meta), (values_t, meta_t)) in plain jnp."""
  mask = transposable_mask_reference(w)
  return (mask, compress24_reference(w, mask),
          compress24_reference(w.T, mask.T))


# ----------------------------------------------------------------------------
# Benchmark rows (python -m s24jax.kernels.bench; kernels/bench_harness.py).
# ----------------------------------------------------------------------------
def _bench_transposable(shapes, dtype, interpret, reps):
  for n, k in shapes:
    w = jax.random.normal(jax.random.key(0), (n, k), dtype)
    for wc in (False, True):
      fast = jax.jit(functools.partial(transposable_mask24, with_compressed=wc,
                                       interpret=interpret))
      ref = jax.jit(transposable_compressed_reference if wc
                    else transposable_mask_reference)
      out_bytes = w.size * (1 + (2 * w.dtype.itemsize * 0.5 + 0.25 if wc else 0))
      yield bench_harness.row("transposable" + ("+compress" if wc else ""), (n, k),
                       bench_harness.time_fn(fast, w, reps=reps),
                       bench_harness.time_fn(ref, w, reps=reps),
                       nbytes=w.size * w.dtype.itemsize + out_bytes)


BENCHMARKS = {"transposable": _bench_transposable}


if __name__ == "__main__":   # this family's rows of python -m s24jax.kernels.bench
  raise SystemExit(bench_harness.main(
      BENCHMARKS, prog="python -m s24jax.kernels.transposable_mask",
      description="Benchmark transposable_mask24 against XLA."))
