"""cuSPARSELt's compressed 2:4 operand, written by s24jax: its byte layout per GPU generation and
element size, `compress` in jnp (so XLA fuses it with the projection that makes the operand 2:4:
one read of the dense values, one write of the compressed bytes) and `decompress` (the CPU
stand-in's GEMM and the tests).

The operand is op(A), (m, k) row-major, 2:4 along k: the TN layout, the only one s24jax
compresses itself (ops.py's `Gemm(trans_a=True)`: A stored as op(A), contiguous along k). Its
compressed buffer, as cuSPARSELt's `cusparseLtSpMMACompress` writes it, is

  [values: (m, k/2) row-major in A's dtype, group g's two kept values (at i0 < i1) in order]
  [metadata: m k / 8 bytes, one 4-bit nibble i0 | i1 << 2 per group of four, REORDERED]

9/16 of A's bytes for 16-bit types, 10/16 for 8-bit (rules.py, R9). NVIDIA does not document
the metadata's order; each `Layout` below says where its order comes from, as a permutation of
the nibble array N (m, k/4) into bytes (two nibbles per byte, the first in the low half):

  sm80_16bit  A100 (compute capability 8.x), bf16 / f16. From PyTorch's reverse engineering
              of cuSPARSELt's format (aten/src/ATen/native/sparse/cuda/
              SparseSemiStructuredTile.cu, `MetadataCuSparseLt`, and the warp shuffles of
              SparseSemiStructuredPack.h), made for A100. Blocks of 128 rows x 64 columns
              (1 KiB, blocks column-major), in them 32x32 tiles (column-major), in a tile 32-bit
              words of rows r and r + 8 (16 columns each), rows 0-7 then the tile's lower half.
  sm90_16bit  H100 / H200 (9.0), bf16 / f16. From torchao's sm90 sparsifier for cuSPARSELt
              (torchao/csrc/cuda/activation24/sparsify24.cu, `MetadataCusparseLt16bits`, and
              `store_metadata_reordered` in warp_tensor.h; deleted 2026-01-28). Bands of 64 rows,
              in them 32-column blocks of 256 bytes, in them 16-row tiles of 64 bytes whose byte
              (r, p) holds group g = p // 2 + 4 (p % 2) of rows r and r + 8.
  sm90_8bit   H100 / H200, e4m3 / e5m2. A HYPOTHESIS: no public description of cuSPARSELt's
              8-bit metadata exists; this is CUTLASS's sm90 8-bit order as torchao writes it
              for CUTLASS (sparse24_metadata.h, `MetadataCutlass8bitsSm90`): 128-column stripes,
              in each the rows' 16 bytes in order.

None of the three has been compared with the library's bytes by s24jax (no GPU since they were
written): the backend checks each on a GPU at first use against `cusparseLtSpMMACompress` and
uses the library where the bytes differ (compression.py), and a `gpu` test compares them for
every type and shape class the steps use. Where no layout applies (another GPU, a shape off the
layout's tiles) the library compresses. The CPU stand-in of the library (ops.py) writes and
reads these same layouts, so the CPU suite exercises them in every cuSPARSELt test; for shapes
off every layout's tiles it uses `NATURAL` (nibbles in row order), which is the stand-in's own.

Which two positions a group keeps: its non-zeros, then the lowest-indexed zeros (the project's
`_common.select_two`, with the non-zeros as its keep flags), so an operand that is 2:4 keeps
every value; a group of more than two non-zeros (not 2:4) keeps its two lowest-indexed ones, as
nothing else should be handed to a 2:4 GEMM. For groups with fewer than two non-zeros the
library may pick other (equally valid) positions; the product is the same.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import _common


@dataclasses.dataclass(frozen=True)
class Layout:
  """One compressed layout: the nibble array N (m, k/4) reshaped to `split` (a factorization
  of (m, k/4) into row and group factors), transposed by `perm` (whose last axis, of size 2,
  is the nibble pair of a byte) and flattened (module docstring)."""
  name: str
  element_bytes: int
  row_multiple: int               # m must be a multiple of this
  col_multiple: int               # k must be a multiple of this
  row_split: tuple[int, ...]      # m = the row factors' mixed-radix number (first slowest)
  group_split: tuple[int, ...]    # k/4 likewise; a leading -1 takes what is left
  perm: tuple[int, ...]           # axis order of the bytes (the last axis: the nibble pair)
  source: str
  verified: bool                  # False: a hypothesis (module docstring)

  def supports(self, m: int, k: int) -> bool:
    return m > 0 and k > 0 and not m % self.row_multiple and not k % self.col_multiple

  def split(self, m: int, k: int) -> tuple[int, ...]:
    """The factors of (m, k/4), the leading -1 of each side resolved."""
    def resolve(total, factors):
      rest = 1
      for f in factors[1:]:
        rest *= f
      return (total // rest,) + factors[1:] if factors[0] == -1 else factors
    return resolve(m, self.row_split) + resolve(k // 4, self.group_split)


# Each split names its factors in the comments, slowest first; see the module docstring.
SM80_16BIT = Layout(
    "sm80_16bit", 2, 128, 64,
    row_split=(-1, 4, 2, 2, 8),       # rows: block R, 32-row tile, 16-row half, r and r + 8, r
    group_split=(-1, 2, 2, 2, 2),     # groups: 64-col block, 32-col tile, 16-col half, pair
    perm=(5, 0, 6, 1, 4, 2, 7, 3, 8, 9),
    source="PyTorch's MetadataCuSparseLt (A100)", verified=False)
SM90_16BIT = Layout(
    "sm90_16bit", 2, 64, 32,
    row_split=(-1, 4, 2, 8),          # rows: 64-row band, 16-row tile, r and r + 8, r
    group_split=(-1, 2, 4),           # groups: 32-col block, g // 4, g % 4
    perm=(0, 4, 1, 3, 6, 5, 2),
    source="torchao's sm90 cuSPARSELt sparsifier", verified=False)
SM90_8BIT = Layout(
    "sm90_8bit", 1, 64, 128,
    row_split=(-1,),                  # rows in order
    group_split=(-1, 16, 2),          # groups: 128-col stripe, byte, nibble
    perm=(1, 0, 2, 3),
    source="hypothesis: CUTLASS's sm90 8-bit order (torchao)", verified=False)
# The stand-in's own order where no layout applies: nibbles in row order, two per byte.
NATURAL = Layout("natural", 0, 1, 8, row_split=(-1,), group_split=(-1, 2), perm=(0, 1, 2),
                 source="the CPU stand-in's own", verified=False)
LAYOUTS = (SM80_16BIT, SM90_16BIT, SM90_8BIT)


def for_target(compute_capability: tuple[int, int] | None, element_bytes: int, m: int,
               k: int) -> Layout | None:
  """The layout s24jax writes for op(A) (m, k) of `element_bytes` on a GPU of that compute
  capability, or None where the library must compress (another GPU, a shape off the tiles)."""
  if compute_capability is None:
    return None
  major = compute_capability[0]
  lay = {(8, 2): SM80_16BIT, (9, 2): SM90_16BIT, (9, 1): SM90_8BIT}.get((major, element_bytes))
  return lay if lay is not None and lay.supports(m, k) else None


def compressed_bytes(m: int, k: int, element_bytes: int) -> int:
  return m * k * element_bytes // 2 + m * k // 8


def positions(op_a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(i0, i1, v0, v1) per group of op(A) (m, k): the kept positions i0 < i1 (module docstring)
  and their values, each (m, k/4)."""
  parts = _common.split_positions(op_a)                              # 4 x (m, k/4)
  sel = _common.select_two([p != 0 for p in parts])
  return _common.slots_from_selection(sel, parts)


def _check(lay: Layout, m: int, k: int, dtype) -> None:
  if not lay.supports(m, k):
    raise ValueError(f"cuSPARSELt layout {lay.name}: op(A) ({m}, {k}) is off its tiles (m a "
                     f"multiple of {lay.row_multiple}, k of {lay.col_multiple})")
  if lay.element_bytes and jnp.dtype(dtype).itemsize != lay.element_bytes:
    raise ValueError(f"cuSPARSELt layout {lay.name} is for {lay.element_bytes}-byte elements, "
                     f"not {jnp.dtype(dtype).name}")


def metadata(nib: jax.Array, lay: Layout) -> jax.Array:
  """The metadata bytes (m k / 8,) uint8 of the nibbles (m, k/4) in `lay`'s order."""
  m, g = nib.shape
  n = nib.astype(jnp.uint8).reshape(lay.split(m, 4 * g)).transpose(lay.perm)
  return (n[..., 0] | (n[..., 1] << 4)).reshape(-1)


def nibbles(meta: jax.Array, m: int, k: int, lay: Layout) -> jax.Array:
  """The inverse of `metadata`: the nibbles (m, k/4) uint8 of `lay`'s metadata bytes."""
  split = lay.split(m, k)
  shape = tuple(split[p] for p in lay.perm)
  n = jnp.stack([meta & 15, meta >> 4], -1).reshape(shape)
  inverse = tuple(sorted(range(len(lay.perm)), key=lambda a: lay.perm[a]))
  return n.transpose(inverse).reshape(m, k // 4)


def compress(op_a: jax.Array, lay: Layout) -> jax.Array:
  """op(A) (m, k), 2:4 along k, as cuSPARSELt's compressed buffer in `lay`: uint8
  (compressed_bytes(m, k, itemsize),). Pure jnp: XLA fuses it with whatever produced op(A)."""
  m, k = op_a.shape
  _check(lay, m, k, op_a.dtype)
  i0, i1, v0, v1 = positions(op_a)                                   # 4 x (m, k/4)
  # A select of broadcasts, not a stack (a concatenate): XLA fuses it with its producers.
  slot = jax.lax.broadcasted_iota(jnp.int32, (m, k // 4, 2), 2)
  values = jnp.where(slot == 0, v0[..., None], v1[..., None])        # (m, k/4, 2)
  value_bytes = jax.lax.bitcast_convert_type(values, jnp.uint8).reshape(-1)
  return jnp.concatenate([value_bytes, metadata(_common.nibble(i0, i1), lay)])


def decompress(buffer: jax.Array, m: int, k: int, dtype, lay: Layout) -> jax.Array:
  """The inverse of `compress`: op(A) (m, k) in `dtype`."""
  _check(lay, m, k, dtype)
  itemsize = jnp.dtype(dtype).itemsize
  if buffer.shape != (compressed_bytes(m, k, itemsize),):
    raise ValueError(f"cuSPARSELt layout {lay.name}: a compressed ({m}, {k}) "
                     f"{jnp.dtype(dtype).name} operand has {compressed_bytes(m, k, itemsize)} "
                     f"bytes, not {buffer.shape}")
  n_values = m * k // 2
  value_bytes = buffer[:n_values * itemsize]
  if itemsize > 1:
    value_bytes = value_bytes.reshape(n_values, itemsize)
  values = jax.lax.bitcast_convert_type(value_bytes, dtype).reshape(m, k // 4, 2)
  nib = nibbles(buffer[n_values * itemsize:], m, k, lay)
  dense = _common.expand_positions(values[..., 0], values[..., 1], nib.astype(jnp.uint32))
  return _common.interleave(dense)                                    # (m, k)
