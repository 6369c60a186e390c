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


def _nibble_table() -> tuple[int, int]:
  """The nibble i0 | i1 << 2 of each pattern Z = sum_j 2^j (x_j != 0) of a group's non-zeros,
  by `_common.select_two`'s key (module docstring: non-zeros, then the lowest-indexed zeros):
  patterns 0-7 in the first 32-bit word, 8-15 in the second, 4 bits each."""
  words = [0, 0]
  for z in range(16):
    kept = sorted(range(4), key=lambda j: j + (0 if z >> j & 1 else 4))[:2]   # select_two's key
    i0, i1 = sorted(kept)
    words[z >> 3] |= (i0 | i1 << 2) << 4 * (z & 7)
  return words[0], words[1]


_NIBBLES_LOW, _NIBBLES_HIGH = _nibble_table()


def _nibble_of(parts) -> jax.Array:
  """The nibbles (uint32) of groups given as their four members (same-shaped arrays): a table
  lookup by shift, a handful of elementwise ops that XLA fuses into whatever reads them (a
  ranking of the four would make it materialize them, see `compress`)."""
  nz = [(p != 0).astype(jnp.uint32) for p in parts]
  z = nz[0] | nz[1] << 1 | nz[2] << 2
  table = jnp.where(nz[3] != 0, jnp.uint32(_NIBBLES_HIGH), jnp.uint32(_NIBBLES_LOW))
  return (table >> (z << 2)) & 15


def positions(op_a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(i0, i1, v0, v1) per group of op(A) (m, k): the kept positions i0 < i1 (module docstring)
  and their values, each (m, k/4)."""
  m, k = op_a.shape
  groups = op_a.reshape(m, k // 4, 4)
  nib = _nibble_of([groups[..., j] for j in range(4)])
  i0, i1 = nib & 3, nib >> 2
  # Gathers, not selects among the four: XLA fuses these into the compression's one pass
  # where a select chain (each member used thrice) made it write op(A) out first.
  take = lambda i: jnp.take_along_axis(   # noqa: E731
      groups, i[..., None].astype(jnp.int32), axis=-1, mode="promise_in_bounds")[..., 0]
  return i0, i1, take(i0), take(i1)


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


def _word_order(lay: Layout, m: int, k: int):
  """`lay`'s byte order refined so that a uint32 word (four consecutive metadata bytes) is
  whole axes: (natural, sizes, output, word), axis ids with `natural` their order in the
  nibble array's reshape, `output` their order in the buffer (the nibble pair last) and
  `word` the axes inside a word (output order, slowest first). None where the bytes do not
  group into words along whole axes (then `compress` writes bytes)."""
  split = lay.split(m, k)
  sizes = dict(enumerate(split))
  natural, output = list(range(len(split))), list(lay.perm)
  need, word, pos = 4, [], len(output) - 2
  while need > 1:
    if pos < 0:
      return None
    ax = output[pos]
    if need % sizes[ax] == 0:                    # the whole axis goes into the word
      need //= sizes[ax]
      word.insert(0, ax)
      pos -= 1
    elif sizes[ax] % need == 0:                  # its fastest `need` values do: split it
      low = len(sizes)
      sizes[ax], sizes[low] = sizes[ax] // need, need
      natural.insert(natural.index(ax) + 1, low)
      output.insert(output.index(ax) + 1, low)
      word.insert(0, low)
      need = 1
    else:
      return None
  return natural, sizes, output, word


def _meta_words(op_a: jax.Array, order) -> jax.Array:
  """The metadata (m k / 32,) uint32 of op(A), computed in op(A)'s own order (each word from
  the groups it packs, read as slices) and transposed into the layout's order last: a
  transpose of words, which XLA folds into the compression's kernel when op(A) is not itself
  a transposed array (from one, it is a kernel of its own: traffic.py, note 2)."""
  natural, sizes, output, word = order
  pair = output[-1]
  x = op_a.reshape([sizes[a] for a in natural] + [4])      # the nibble axes, then the group
  fixed = word + [pair]
  rest = [a for a in natural if a not in fixed]
  words = None
  for flat in range(8):                                     # 4 bytes x 2 nibbles
    at, r = {}, flat
    for a in reversed(fixed):
      at[a], r = r % sizes[a], r // sizes[a]
    index = tuple(at.get(a, slice(None)) for a in natural)
    nib = _nibble_of([x[index + (j,)] for j in range(4)])  # axes `rest`
    byte = flat // 2                                        # the word axes' mixed radix
    shifted = nib << (8 * byte + 4 * at[pair])
    words = shifted if words is None else words | shifted
  out_rest = [a for a in output if a not in fixed]
  return words.transpose([rest.index(a) for a in out_rest]).reshape(-1)


def _value_words(v0: jax.Array, v1: jax.Array) -> jax.Array | None:
  """The values section as uint32 words (little-endian, as the buffer's bytes): one group's
  two values per word for 16-bit types, two groups' for 8-bit ones; None for other sizes."""
  size = jnp.dtype(v0.dtype).itemsize
  if size not in (1, 2) or (size == 1 and v0.shape[-1] % 2):
    return None
  bits = lambda v: jax.lax.bitcast_convert_type(   # noqa: E731
      v, jnp.uint16 if size == 2 else jnp.uint8).astype(jnp.uint32)
  if size == 2:
    return bits(v0) | bits(v1) << 16
  even, odd = (v.reshape(*v.shape[:-1], -1, 2) for v in (v0, v1))
  return (bits(even[..., 0]) | bits(odd[..., 0]) << 8 | bits(even[..., 1]) << 16
          | bits(odd[..., 1]) << 24)


def compress(op_a: jax.Array, lay: Layout) -> jax.Array:
  """op(A) (m, k), 2:4 along k, as cuSPARSELt's compressed buffer in `lay`: uint8
  (compressed_bytes(m, k, itemsize),). Pure jnp: XLA fuses it with whatever produced op(A).

  Written for XLA:GPU's fusion (deviceless H100 compiles, s24jax/perf/compression_traffic.py; not
  measured on a GPU): the buffer is uint32 words, the values' and the metadata's, each word
  computed from the groups it holds with elementwise ops, and one concatenate of the two
  sections, bitcast to bytes at the end. So XLA can make one kernel of the projection and the
  compression (it does for the hard and S-STE projections at GPT-2 124M's shapes on an
  H100), reading the projection's input once for the values and once more (in the same
  kernel, unseen by XLA's byte count) for the metadata. Bytes instead of words (a uint8
  bitcast of the values, a byte-wise metadata) made XLA write the values out and copy them
  into the concatenate.
  """
  m, k = op_a.shape
  _check(lay, m, k, op_a.dtype)
  i0, i1, v0, v1 = positions(op_a)                                   # 4 x (m, k/4)
  values = _value_words(v0, v1)
  order = _word_order(lay, m, k)
  if values is not None and order is not None:
    words = jnp.concatenate([values.reshape(-1), _meta_words(op_a, order)])
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
  # Elsewhere (the stand-in's NATURAL order on shapes off every tile, other element sizes):
  # the values' bytes then the metadata's, as the module docstring lays them out.
  slot = jax.lax.broadcasted_iota(jnp.int32, (m, k // 4, 2), 2)
  pairs = jnp.where(slot == 0, v0[..., None], v1[..., None])        # (m, k/4, 2)
  value_bytes = jax.lax.bitcast_convert_type(pairs, jnp.uint8).reshape(-1)
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
