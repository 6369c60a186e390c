"""V:N:M activation sparsity (VENOM, N = 2 of 4 chosen columns) and its matmul.

Why: Haziza et al. sparsify the activations that feed the second FFN matmul
(Squared-ReLU activations are naturally sparse). Selecting the V:N:M pattern
and compressing it in one pass, then multiplying from the compressed form,
avoids materialising the dense masked activation.

Format, for x [R, C] with blocks of V rows x M columns (C = contraction axis):
  * cols    [R/V, C/M, 4] int32: the 4 in-block columns (0..M-1, ascending)
            shared by the V rows of a block, chosen to maximise the kept
            magnitude: all C(M, 4) subsets are enumerated (70 for M = 8);
            score(S) = sum over the V rows of the two largest |x| in S; the
            first best subset in lexicographic order wins ties (exactly
            `s24jax.kernels.masks.venom_select` with n = 2, the reference; see
            docs/algorithms.md, "Activation sparsity, V:N:M").
  * values  [R, 2 * C/M]: per row and block, the two kept values (2:4 inside
            the 4 chosen columns: the two largest |x|, ties to the lower).
  * meta    [R, ceil((C/M) / 8)] uint32: per row and block, the positions
            (0..3, within the 4 chosen columns) of the two kept values, in the
            package metadata format (`kernels/_common.py`).
So (values, meta) is exactly `compress24` of the condensed [R, 4 * C/M]
matrix; `cols` maps condensed column 4b + k to dense column M*b + cols[., b, k].

Matmul: y = x_vnm @ W2^T for a dense W2 [out, C]: per row block, gather the
4 * C/M chosen columns of W2 (one gathered load per condensed position) and
multiply by the expanded condensed activations. Half (M = 8) of the dense
FLOPs; the W2 gather is uncoalesced, so the win is FLOPs, not bytes. W2 in
2:4 form is not supported here (the two sparsities do not compose into one
tile without a second gather through W2's metadata).
Neither function is differentiable (integer metadata); the straight-through
rule for activation sparsity belongs to the model code.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _common as c
from .sparsify24 import compress24_reference
from . import masks
from . import bench_harness


def column_subsets(m: int) -> tuple[tuple[int, int, int, int], ...]:
  """All 4-column subsets of an M-wide block, lexicographic (tie order)."""
  return tuple(itertools.combinations(range(m), 4))


@dataclasses.dataclass(frozen=True)
class VenomConfig(c.BlockConfig):
  """block_blocks: column blocks per program (power of two, >= 8 so a tile
  holds whole metadata words; the matmul uses max(block_blocks, 16), its MMA
  K). block_n: output features per matmul program.

  Defaults: the compress tile is v x (8 * m) = 64 x 64 at the project's v = 64,
  m = 8, and 8 warps: 16 elements per thread, ~100 registers and no spills on
  sm_80 / sm_90a (16 blocks or 4 warps reach 255 registers and spill;
  `python -m s24jax.kernels.compile_check`)."""
  block_blocks: int = 8
  block_n: int = 64
  num_warps: int = dataclasses.field(default=8, kw_only=True)

  def __post_init__(self):
    super().__post_init__()
    if self.block_blocks < c.GROUPS_PER_WORD:
      raise ValueError("block_blocks must be >= 8 (one metadata word).")


def _top2_sum(a, b, cc, d):
  """Sum of the two largest of four (non-negative) arrays."""
  hi1, lo1 = jnp.maximum(a, b), jnp.minimum(a, b)
  hi2, lo2 = jnp.maximum(cc, d), jnp.minimum(cc, d)
  return (jnp.maximum(hi1, hi2)
          + jnp.maximum(jnp.minimum(hi1, hi2), jnp.maximum(lo1, lo2)))


def _venom_kernel(x_ref, values_ref, meta_ref, cols_ref, *, m, nb, row_blocks,
                  total_blocks):
  del row_blocks
  # a[j][v, b] = x[v, M*b + j]: one strided load per in-block column.
  a = [x_ref[:, pl.ds(j, nb, stride=m)] for j in range(m)]
  mags = [jnp.abs(v.astype(jnp.float32)) for v in a]
  # Running best over the subsets; the winner is kept as an M-bit code
  # (bit j set = column j chosen), one select per subset.
  best = None
  code = None
  for sub in column_subsets(m):
    score = jnp.sum(_top2_sum(*(mags[j] for j in sub)), axis=0, keepdims=True)
    sub_code = sum(1 << j for j in sub)
    if best is None:
      best, code = score, jnp.full(score.shape, sub_code, jnp.int32)
    else:
      better = score > best
      best = jnp.where(better, score, best)
      code = jnp.where(better, sub_code, code)
  # k-th chosen column = the set bit with k set bits below it.
  chosen = [jnp.zeros_like(code) for _ in range(4)]
  cv = [jnp.zeros_like(a[0]) for _ in range(4)]
  below = jnp.zeros_like(code)
  for j in range(m):
    bit = ((code >> j) & 1) == 1
    for k in range(min(j, 3) + 1):
      hit = bit & (below == k)
      chosen[k] = jnp.where(hit, j, chosen[k])
      cv[k] = jnp.where(hit, a[j], cv[k])
    below = below + bit.astype(jnp.int32)
  keep = c.top2_of4([jnp.abs(v) for v in cv])
  i0, i1, v0, v1 = c.slots_from_selection(keep, cv)
  blk = pl.program_id(1) * nb + lax.broadcasted_iota(jnp.int32, i0.shape, 1)
  nib = jnp.where(blk < total_blocks, c.nibble(i0, i1),
                  jnp.uint32(c.EMPTY_NIBBLE))
  values_ref[:, pl.ds(0, nb, stride=2)] = v0
  values_ref[:, pl.ds(1, nb, stride=2)] = v1
  meta_ref[...] = c.pack_nibbles(nib)
  for k in range(4):
    cols_ref[:, pl.ds(k, nb, stride=4)] = chosen[k]


@functools.partial(jax.jit, static_argnames=("v", "m", "config", "interpret",
                                             "poison"))
def _venom(x, *, v, m, config, interpret, poison=False):
  r, cdim = x.shape
  blocks = cdim // m
  nb, bp = c.fit_block(blocks, config.block_blocks, minimum=c.GROUPS_PER_WORD)
  xp = c.pad_axis(x, 1, bp * m)
  values, meta, cols = c.pallas_call(
      functools.partial(_venom_kernel, m=m, nb=nb, row_blocks=r // v,
                        total_blocks=blocks),
      out_shape=[jax.ShapeDtypeStruct((r, 2 * bp), x.dtype),
                 jax.ShapeDtypeStruct((r, bp // c.GROUPS_PER_WORD), jnp.uint32),
                 jax.ShapeDtypeStruct((r // v, 4 * bp), jnp.int32)],
      grid=(r // v, bp // nb),
      in_specs=[pl.BlockSpec((v, nb * m), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((v, 2 * nb), lambda i, j: (i, j)),
                 pl.BlockSpec((v, nb // c.GROUPS_PER_WORD), lambda i, j: (i, j)),
                 pl.BlockSpec((1, 4 * nb), lambda i, j: (i, j))],
      num_warps=config.num_warps, num_stages=config.num_stages,
      interpret=interpret, poison=poison, name="venom_sparsify",
  )(xp)
  return (values[:, :2 * blocks],
          meta[:, :-(-blocks // c.GROUPS_PER_WORD)],
          cols[:, :4 * blocks].reshape(r // v, blocks, 4))


def _check_vm(shape, v, m):
  if len(shape) != 2:
    raise ValueError(f"x must be 2-D [rows, cols]; got shape {shape}.")
  c.check_pow2("v", v)
  c.check_pow2("m", m)
  if not 4 <= m <= 16:
    raise ValueError(f"m={m}: supported block widths are 4, 8, 16.")
  if shape[0] % v:
    raise ValueError(f"rows (axis 0) = {shape[0]} must be a multiple of "
                     f"v = {v}.")
  if shape[1] % m:
    raise ValueError(f"columns (axis 1) = {shape[1]} must be a multiple of "
                     f"m = {m}.")


def venom_compress(x: jax.Array, v: int = 16, m: int = 8, *,
                   interpret: bool = False, config: VenomConfig | None = None):
  """V:2:M sparsify + compress x [R, C] -> (values, meta, cols); see module.

  v: rows per block (power of two; >= 16 for the native matmul);
  m: columns per block (4, 8 or 16; C(m, 4) subsets are enumerated).
  """
  _check_vm(x.shape, v, m)
  return _venom(x, v=v, m=m, config=config or VenomConfig(),
                interpret=interpret)


def venom_decompress(values, meta, cols, v: int, m: int) -> jax.Array:
  """(values, meta, cols) -> dense V:N:M-sparse [R, C] (plain jnp)."""
  r = values.shape[0]
  blocks = cols.shape[1]
  cond = c.decompress(values, meta)                  # [R, 4 * blocks]
  colr = jnp.repeat(cols, v, axis=0)                 # [R, blocks, 4]
  dense_idx = (jnp.arange(blocks, dtype=jnp.int32)[None, :, None] * m + colr)
  out = jnp.zeros((r, blocks * m), values.dtype)
  rows = jnp.arange(r)[:, None]
  return out.at[rows, dense_idx.reshape(r, -1)].set(cond)


def venom_reference(x: jax.Array, v: int = 16, m: int = 8):
  """Plain-jnp reference of `venom_compress`: the selection is
  `s24jax.kernels.masks.venom_select` (n = 2), compressed in the package format."""
  _check_vm(x.shape, v, m)
  r, cdim = x.shape
  blocks = cdim // m
  mask, cols = masks.venom_select(x, v, 2, m)                  # cols [R/V, B, 4]
  idx = jnp.repeat(cols, v, axis=0)                            # [R, B, 4]
  take = lambda a: jnp.take_along_axis(a.reshape(r, blocks, m), idx,
                                       axis=-1).reshape(r, 4 * blocks)
  values, meta = compress24_reference(take(x), take(mask))
  return values, meta, cols


def _vnm_matmul_kernel(values_ref, meta_ref, cols_ref, w_ref, y_ref, *, m, nb,
                       bn, blocks):
  v = values_ref.shape[0]
  rows_w = lax.broadcasted_iota(jnp.int32, (bn, 1), 0)

  def body(s, acc):
    b0 = pl.multiple_of(s * nb, nb)
    v0 = values_ref[:, pl.ds(2 * b0, nb, stride=2)]
    v1 = values_ref[:, pl.ds(2 * b0 + 1, nb, stride=2)]
    words = meta_ref[:, pl.ds(b0 // c.GROUPS_PER_WORD, nb // c.GROUPS_PER_WORD)]
    d = c.expand_positions(v0, v1, c.unpack_nibbles(words))
    base = (b0 + lax.broadcasted_iota(jnp.int32, (1, nb), 1)) * m
    for k in range(4):
      ck = cols_ref[:, pl.ds(4 * b0 + k, nb, stride=4)]        # [1, nb]
      wk = w_ref[rows_w, base + ck]                            # [bn, nb]
      prec = lax.Precision.HIGHEST if wk.dtype == jnp.float32 else None
      acc += lax.dot_general(d[k].astype(wk.dtype), wk,
                             (((1,), (1,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32)
    return acc

  acc = lax.fori_loop(0, blocks // nb, body,
                      jnp.zeros((v, bn), jnp.float32))
  y_ref[...] = acc.astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("v", "m", "config", "interpret",
                                             "poison"))
def _vnm_matmul(values, meta, cols, w, *, v, m, config, interpret,
                poison=False):
  r = values.shape[0]
  blocks = cols.shape[1]
  out = w.shape[0]
  nb, bp = c.fit_block(blocks, max(config.block_blocks, 16), minimum=16)
  bn, op = c.fit_block(out, max(config.block_n, 16), minimum=16)
  values = c.pad_axis(values, 1, 2 * bp)
  meta = c.pad_axis(meta, 1, bp // c.GROUPS_PER_WORD, c.EMPTY_WORD)
  cols2 = c.pad_axis(cols.reshape(r // v, 4 * blocks), 1, 4 * bp)
  w = c.pad_axis(c.pad_axis(w, 1, bp * m), 0, op)
  (y,) = c.pallas_call(
      functools.partial(_vnm_matmul_kernel, m=m, nb=nb, bn=bn, blocks=bp),
      out_shape=[jax.ShapeDtypeStruct((r, op), values.dtype)],
      grid=(r // v, op // bn),
      in_specs=[pl.BlockSpec((v, 2 * bp), lambda i, j: (i, 0)),
                pl.BlockSpec((v, bp // c.GROUPS_PER_WORD), lambda i, j: (i, 0)),
                pl.BlockSpec((1, 4 * bp), lambda i, j: (i, 0)),
                pl.BlockSpec((bn, bp * m), lambda i, j: (j, 0))],
      out_specs=[pl.BlockSpec((v, bn), lambda i, j: (i, j))],
      num_warps=config.num_warps, num_stages=config.num_stages,
      interpret=interpret, poison=poison, name="venom_matmul",
  )(values, meta, cols2, w)
  return y[:, :out]


def venom_matmul(values, meta, cols, w2, *, v: int, m: int,
                 interpret: bool = False, config: VenomConfig | None = None):
  """y [R, out] = x_vnm @ w2^T from the compressed V:N:M activations.

  w2: dense [out, C] with C = M * cols.shape[1], same dtype as values.
  Padded meta words use the EMPTY nibble and padded values are zero, so
  padding never contributes.
  """
  r = values.shape[0]
  if cols.ndim != 3 or cols.shape[2] != 4 or cols.shape[0] * v != r:
    raise ValueError(f"cols must be [R/V, C/M, 4] = [{r // v}, ., 4]; got "
                     f"{cols.shape}.")
  blocks = cols.shape[1]
  if values.shape != (r, 2 * blocks):
    raise ValueError(f"values must be [R, 2*C/M] = {(r, 2 * blocks)}; got "
                     f"{values.shape}.")
  if meta.shape != (r, -(-blocks // c.GROUPS_PER_WORD)):
    raise ValueError(f"meta shape {meta.shape} != [R, ceil((C/M)/8)].")
  if w2.ndim != 2 or w2.shape[1] != m * blocks:
    raise ValueError(f"w2 must be [out, C] with C = m * C/M = {m * blocks}; "
                     f"got {w2.shape}.")
  if w2.dtype != values.dtype:
    raise ValueError(f"w2 ({w2.dtype}) and values ({values.dtype}) must share "
                     "a dtype.")
  _check_vm((r, m * blocks), v, m)
  return _vnm_matmul(values, meta.astype(jnp.uint32), cols.astype(jnp.int32),
                     w2, v=v, m=m, config=config or VenomConfig(),
                     interpret=interpret)


def venom_matmul_reference(values, meta, cols, w2, *, v: int, m: int):
  x = venom_decompress(values, meta, cols, v, m)
  prec = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  return jnp.dot(x, w2.T, precision=prec,
                 preferred_element_type=jnp.float32).astype(x.dtype)


# ----------------------------------------------------------------------------
# Benchmark rows (python -m s24jax.kernels.bench; kernels/bench_harness.py).
# ----------------------------------------------------------------------------
def _bench_venom(shapes, dtype, interpret, reps, v=16, m=8):
  for t, d in shapes:
    h = 4 * d
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.nn.relu(jax.random.normal(kx, (t, h), dtype)) ** 2
    w2 = jax.random.normal(kw, (d, h), dtype)
    comp = jax.jit(functools.partial(venom_compress, v=v, m=m, interpret=interpret))
    comp_ref = jax.jit(functools.partial(venom_reference, v=v, m=m))
    yield bench_harness.row(f"venom_compress({v}:2:{m})", (t, h),
                     bench_harness.time_fn(comp, x, reps=reps),
                     bench_harness.time_fn(comp_ref, x, reps=reps),
                     nbytes=x.size * x.dtype.itemsize * (1 + 2 / m))
    got = comp(x)
    xs = venom_decompress(*got, v, m)
    mm = jax.jit(functools.partial(venom_matmul, v=v, m=m, interpret=interpret))
    yield bench_harness.row(f"venom_matmul({v}:2:{m})", (t, d, h),
                     bench_harness.time_fn(mm, *got, w2, reps=reps),
                     bench_harness.time_fn(jax.jit(bench_harness.dense_mm), xs, w2, reps=reps),
                     flops=2 * t * d * h, note="TFLOPs dense-equivalent")


BENCHMARKS = {"venom": _bench_venom}


if __name__ == "__main__":   # this family's rows of python -m s24jax.kernels.bench
  raise SystemExit(bench_harness.main(
      BENCHMARKS, prog="python -m s24jax.kernels.venom",
      description="Benchmark venom_compress / venom_matmul against XLA."))
