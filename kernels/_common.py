"""Shared plumbing for the s24jax Pallas kernels (Triton backend).

Everything here exists because several kernel families need the exact same
thing, and a second copy would drift:

* the 2:4 metadata format (one nibble per group of four, eight per uint32),
  with its pack/unpack helpers that run both inside a kernel and in plain jnp;
* the "which two of four" selection with the project-wide tie rule (ties go to
  the lower index, as in `s24jax.kernels.masks.nm_mask`);
* a `pallas_call` builder that always passes Triton compiler params (the
  kernels are written for the Triton backend: they never depend on which
  backend jax picks by default for a GPU `pallas_call`) and
  can poison the outputs (NaN / all-ones) through `input_output_aliases`, so a
  test sees every element a kernel forgets to write;
* block-size selection (powers of two, as the Triton backend requires), the
  padding that goes with it, and `BlockConfig`, the base of every kernel's
  tile config;
* the argument checks every public wrapper repeats (`check_float_groups`);
* `interpret_default()`, the one rule for when a caller that does not say
  otherwise runs the kernels in Pallas interpret mode (off a GPU).

(Over 400 lines, one module on purpose: the metadata format below and the
helpers that pack, select and expand it are one contract; split up, the
format's documentation and its code would drift apart. The benchmarks' timing
and tables live in `bench_harness.py`.)

Metadata format (used by every compressed 2:4 array in this package)
---------------------------------------------------------------------
For a row of K entries (K % 4 == 0) there are G = K/4 groups. Group g keeps
two entries at in-group positions i0 < i1 (each 0..3). Its nibble is
``i0 | (i1 << 2)`` (4 bits), and ``meta[..., g // 8]`` holds group g's nibble
in bits ``4 * (g % 8) .. 4 * (g % 8) + 3``: eight groups per uint32, lowest
group in the lowest bits, ``meta.shape[-1] == ceil(K / 32)``. The compressed
values are ``values[..., 2 * g + s] = w[..., 4 * g + i_s]`` (s = 0, 1), so
``values.shape[-1] == K / 2`` and the kept values keep their original order.
A group with nothing to keep encodes as (i0, i1) = (0, 1) with zero values;
that is also what the unused nibbles of the last word hold. A valid nibble
always has i0 < i1, so 0x0 and 0xF never occur, which makes an unwritten
(zero or all-ones) word detectable.

Why this layout: a GPU kernel that expands a [rows, BK] tile reads
[rows, BK/32] words, broadcasts each word over its 8 groups and shifts by
4 * (g % 8): a broadcast, a reshape, a shift and a mask, no gather. The nibble
content is what NVIDIA's mma.sp / cuSPARSELt use for 16-bit types (two 2-bit
indices per group of four); the interleaving of words across threads that
the hardware instruction wants is *not* applied, it is a plain row-major
array.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable, ClassVar, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

GROUPS_PER_WORD = 8          # nibbles per uint32 metadata word
COLS_PER_WORD = 4 * GROUPS_PER_WORD
EMPTY_NIBBLE = 0 | (1 << 2)  # (i0, i1) = (0, 1): what an all-zero group encodes
EMPTY_WORD = 0x44444444      # eight EMPTY nibbles


def triton_params(num_warps: int, num_stages: int):
  """Explicit Triton compiler params (never rely on the backend default).

  Imported here, not at module level: the Pallas Triton backend is deprecated (jax 0.11 and
  0.12 warn), and when it goes, importing s24jax must still work, with only the Triton
  kernels failing (docs/kernels.md, "The Pallas Triton backend's deprecation")."""
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  # jax renamed TritonCompilerParams -> CompilerParams (0.7); both are looked up.
  params = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
  return params(num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------
# Shapes and blocks.
# ----------------------------------------------------------------------------
def is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def check_pow2(name: str, value: int) -> None:
  if not is_pow2(value):
    raise ValueError(
        f"{name}={value} must be a power of two (Triton block shapes are).")


def fit_block(dim: int, preferred: int, minimum: int = 1) -> tuple[int, int]:
  """Chooses a power-of-two block for an axis of length `dim`.

  Returns (block, padded_dim). Prefers the largest power of two in
  [minimum, preferred] that divides `dim` (no padding). If none divides, the
  block is min(preferred, max(minimum, next_power_of_2(dim))) and the axis is
  padded up to a multiple of it, so callers never take a partial block.
  """
  check_pow2("preferred block", preferred)
  check_pow2("minimum block", minimum)
  preferred = max(preferred, minimum)
  b = preferred
  while b >= minimum:
    if dim % b == 0:
      return b, dim
    b //= 2
  b = min(preferred, max(minimum, pl.next_power_of_2(dim)))
  return b, -(-dim // b) * b


def pad_axis(x: jax.Array, axis: int, new_size: int, value=0) -> jax.Array:
  """Pads axis `axis` of x at the end up to `new_size` (no-op when equal)."""
  axis = axis % x.ndim
  extra = new_size - x.shape[axis]
  if extra == 0:
    return x
  if extra < 0:
    raise ValueError(f"cannot pad axis {axis} of {x.shape} down to {new_size}")
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


@dataclasses.dataclass(frozen=True)
class RowTiling:
  """A [..., K] array seen as [rows, K] and padded to whole [br, bc] tiles
  (bc >= 32: whole metadata words), for the one-pass compress kernels."""
  lead: tuple[int, ...]
  rows: int
  k: int
  br: int
  bc: int
  rp: int
  kp: int

  @classmethod
  def of(cls, shape, block_rows: int, block_cols: int) -> "RowTiling":
    lead, k = tuple(shape[:-1]), shape[-1]
    rows = int(np.prod(lead)) if lead else 1
    bc, kp = fit_block(k, block_cols, minimum=COLS_PER_WORD)
    br, rp = fit_block(rows, block_rows)
    return cls(lead, rows, k, br, bc, rp, kp)

  def pad(self, x: jax.Array, value=0) -> jax.Array:
    """[..., K] -> padded [rp, kp]."""
    x2 = x.reshape(self.rows, self.k)
    return pad_axis(pad_axis(x2, 1, self.kp, value), 0, self.rp, value)

  @property
  def grid(self) -> tuple[int, int]:
    return (self.rp // self.br, self.kp // self.bc)

  def in_spec(self) -> pl.BlockSpec:
    """The [br, bc] tile of a padded [rp, kp] input."""
    return pl.BlockSpec((self.br, self.bc), lambda i, j: (i, j))

  def compressed_outputs(self, dtype):
    """(out_shape, out_specs) of padded (values [rp, kp/2], meta [rp, kp/32])."""
    shapes = [jax.ShapeDtypeStruct((self.rp, self.kp // 2), dtype),
              jax.ShapeDtypeStruct((self.rp, self.kp // COLS_PER_WORD),
                                   jnp.uint32)]
    specs = [pl.BlockSpec((self.br, self.bc // 2), lambda i, j: (i, j)),
             pl.BlockSpec((self.br, self.bc // COLS_PER_WORD),
                          lambda i, j: (i, j))]
    return shapes, specs

  def unpad_compressed(self, values: jax.Array, meta: jax.Array):
    """Padded ([rp, kp/2], [rp, kp/32]) -> ([..., K/2], [..., ceil(K/32)])."""
    words = meta_words(self.k)
    return (values[:self.rows, :self.k // 2].reshape(*self.lead, self.k // 2),
            meta[:self.rows, :words].reshape(*self.lead, words))


def check_groups(name: str, k: int, m: int = 4) -> None:
  if k % m:
    raise ValueError(
        f"2:4 sparsity needs the contraction (last) dimension of {name} to be a "
        f"multiple of {m}; got {k}.")


def check_float_groups(name: str, x: jax.Array, m: int = 4) -> None:
  """The public wrappers' argument check: a floating array (at least one axis)
  whose last axis splits into groups of m."""
  if x.ndim < 1:
    raise ValueError(f"{name} must have at least one axis; got a scalar.")
  check_groups(name, x.shape[-1], m)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating point; got {x.dtype}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
  """Base of the kernels' tile configs (frozen, hashable: a static argument).

  Every field whose name contains "block" must be a power of two (Triton block
  shapes are); the fields listed in `WORD_ALIGNED` must also hold at least one
  metadata word of columns (>= 32). Subclasses add their tile fields; these
  two launch parameters are common to all.
  """
  WORD_ALIGNED: ClassVar[tuple[str, ...]] = ()
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if "block" in f.name:
        check_pow2(f.name, getattr(self, f.name))
    for name in self.WORD_ALIGNED:
      if getattr(self, name) < COLS_PER_WORD:
        raise ValueError(f"{name}={getattr(self, name)} must be >= "
                         f"{COLS_PER_WORD} (one metadata word).")


def meta_words(k: int) -> int:
  """Number of uint32 metadata words for a row of k entries."""
  return -(-(k // 4) // GROUPS_PER_WORD)


# ----------------------------------------------------------------------------
# 2:4 selection, used inside kernels and in the jnp references alike.
# All functions take per-position arrays (one array per in-group position) so
# a Triton kernel never needs a register gather or a size-4 axis.
# ----------------------------------------------------------------------------
def _two_smallest_ranks(beats) -> list[jax.Array]:
  """Flags of the two entries (of four) that fewer than two others beat.

  beats(i, j) -> bool array: entry i beats entry j. A strict total order
  makes exactly two flags true per group.
  """
  keep = []
  for j in range(4):
    ranks = [beats(i, j).astype(jnp.int32) for i in range(4) if i != j]
    keep.append(functools.reduce(operator.add, ranks) < 2)
  return keep


def top2_of4(mags: Sequence[jax.Array]) -> list[jax.Array]:
  """Keep flags of the two largest of four magnitudes; ties -> lower index.

  Entry j is kept when fewer than two entries beat it, where i beats j if
  |w_i| > |w_j|, or |w_i| == |w_j| and i < j (a stable ranking, identical to
  `s24jax.kernels.masks.nm_mask`).
  """
  return _two_smallest_ranks(
      lambda i, j: (mags[i] > mags[j]) if i > j else (mags[i] >= mags[j]))


def select_two(keep: Sequence[jax.Array]) -> list[jax.Array]:
  """Picks exactly two slots out of four from arbitrary keep flags.

  Priority: kept entries first, then lower index (key = 4 * (not kept) + j).
  For exactly-two-kept groups this is the identity; a group with fewer kept
  entries is topped up with the lowest unkept positions (their values are
  written as zero); with more than two kept the two lowest-indexed win.
  """
  key = [jnp.where(keep[j], j, 4 + j) for j in range(4)]
  return _two_smallest_ranks(lambda i, j: key[i] < key[j])


def slots_from_selection(sel: Sequence[jax.Array], vals: Sequence[jax.Array]):
  """(i0, i1, v0, v1) from exactly-two selection flags, i0 < i1."""
  s0, s1, s2, s3 = sel
  i0 = jnp.where(s0, 0, jnp.where(s1, 1, 2)).astype(jnp.uint32)
  i1 = jnp.where(s3, 3, jnp.where(s2, 2, 1)).astype(jnp.uint32)
  v0 = jnp.where(s0, vals[0], jnp.where(s1, vals[1], vals[2]))
  v1 = jnp.where(s3, vals[3], jnp.where(s2, vals[2], vals[1]))
  return i0, i1, v0, v1


def nibble(i0: jax.Array, i1: jax.Array) -> jax.Array:
  return i0.astype(jnp.uint32) | (i1.astype(jnp.uint32) << 2)


def pack_nibbles(nib: jax.Array) -> jax.Array:
  """[..., G] uint32 nibbles (G % 8 == 0) -> [..., G/8] uint32 words."""
  *lead, g = nib.shape
  nib = nib.reshape(*lead, g // GROUPS_PER_WORD, GROUPS_PER_WORD)
  shift = lax.broadcasted_iota(jnp.uint32, nib.shape, nib.ndim - 1) * 4
  # The nibbles occupy disjoint bits, so a sum is an OR (Triton has sum).
  return jnp.sum(nib << shift, axis=-1, dtype=jnp.uint32)


def pack_nibbles_along_rows(nib: jax.Array) -> jax.Array:
  """[G, C] uint32 nibbles (G % 8 == 0), groups along axis 0 -> [G/8, C] words:
  `pack_nibbles(nib.T).T` without a transpose (for kernels that keep the
  grouped axis first)."""
  g, cols = nib.shape
  nib = nib.reshape(g // GROUPS_PER_WORD, GROUPS_PER_WORD, cols)
  shift = lax.broadcasted_iota(jnp.uint32, nib.shape, 1) * 4
  return jnp.sum(nib << shift, axis=1, dtype=jnp.uint32)


def unpack_nibbles(words: jax.Array) -> jax.Array:
  """[..., W] uint32 words -> [..., 8W] uint32 nibbles (a broadcast + shift)."""
  *lead, w = words.shape
  b = jnp.broadcast_to(words[..., None], (*lead, w, GROUPS_PER_WORD))
  shift = lax.broadcasted_iota(jnp.uint32, b.shape, b.ndim - 1) * 4
  return ((b >> shift) & 15).reshape(*lead, w * GROUPS_PER_WORD)


def expand_positions(v0, v1, nib) -> list[jax.Array]:
  """Dense per-position arrays d_j (j = 0..3) of a compressed tile.

  d_j[..., g] = the dense entry 4g + j. A slot whose index equals j
  contributes its value; a nibble with i0 == i1 (only in padding) adds both.
  """
  i0 = nib & 3
  i1 = (nib >> 2) & 3
  zero = jnp.zeros_like(v0)
  return [jnp.where(i0 == j, v0, zero) + jnp.where(i1 == j, v1, zero)
          for j in range(4)]


# ----------------------------------------------------------------------------
# Plain-jnp compress / decompress in the package format (references).
# ----------------------------------------------------------------------------
def split_positions(x: jax.Array) -> list[jax.Array]:
  """[..., K] -> four [..., K/4] arrays, one per in-group position."""
  g = x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4)
  return [g[..., j] for j in range(4)]


def interleave(parts: Sequence[jax.Array]) -> jax.Array:
  """Inverse of split_positions for any number of parts along the last axis."""
  s = jnp.stack(parts, axis=-1)
  return s.reshape(*s.shape[:-2], s.shape[-2] * s.shape[-1])


def pack_meta_rows(nib: jax.Array) -> jax.Array:
  """[..., G] nibbles (any G) -> [..., ceil(G/8)] words; pads with EMPTY."""
  g = nib.shape[-1]
  gp = -(-g // GROUPS_PER_WORD) * GROUPS_PER_WORD
  nib = pad_axis(nib.astype(jnp.uint32), -1, gp, EMPTY_NIBBLE)
  return pack_nibbles(nib)


def compress_from_keep(w: jax.Array, keep: Sequence[jax.Array]):
  """jnp: dense w [..., K] and per-position keep flags -> (values, meta)."""
  parts = split_positions(w)
  sel = select_two(keep)
  vals = [jnp.where(keep[j], parts[j], jnp.zeros_like(parts[j]))
          for j in range(4)]
  i0, i1, v0, v1 = slots_from_selection(sel, vals)
  return interleave([v0, v1]), pack_meta_rows(nibble(i0, i1))


def decompress(values: jax.Array, meta: jax.Array) -> jax.Array:
  """jnp: (values [..., K/2], meta [..., ceil(K/32)]) -> dense [..., K]."""
  half = values.shape[-1]
  if half % 2:
    raise ValueError(
        f"values' last dimension must be K/2 with K % 4 == 0; got {half}.")
  g = half // 2
  if meta.shape[-1] != meta_words(2 * half):
    raise ValueError(
        f"meta's last dimension must be ceil(K/32) = {meta_words(2 * half)} "
        f"for values of last dimension {half}; got {meta.shape[-1]}.")
  if meta.shape[:-1] != values.shape[:-1]:
    raise ValueError(f"values {values.shape} and meta {meta.shape} disagree "
                     "on the leading dimensions.")
  nib = unpack_nibbles(meta.astype(jnp.uint32))[..., :g]
  pairs = values.reshape(*values.shape[:-1], g, 2)
  return interleave(expand_positions(pairs[..., 0], pairs[..., 1], nib))


# ----------------------------------------------------------------------------
# pallas_call with explicit params and optional output poisoning.
# ----------------------------------------------------------------------------
def poison_value(dtype) -> Any:
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.nan
  if dtype == jnp.bool_:
    return True
  if jnp.issubdtype(dtype, jnp.unsignedinteger):
    return jnp.iinfo(dtype).max
  if jnp.issubdtype(dtype, jnp.integer):
    return -1
  raise TypeError(f"no poison value for {dtype}")


def pallas_call(kernel: Callable, *, out_shape: Sequence[jax.ShapeDtypeStruct],
                grid: tuple[int, ...], in_specs: Sequence[pl.BlockSpec],
                out_specs: Sequence[pl.BlockSpec], num_warps: int,
                num_stages: int, interpret: bool, poison: bool = False,
                name: str | None = None) -> Callable[..., list[jax.Array]]:
  """`pl.pallas_call` with Triton params, returning a list of outputs.

  With `poison=True` every output starts as a NaN / all-ones / True buffer
  (aliased in through `input_output_aliases`), so an element the kernel fails
  to write survives into the result and a full-array comparison catches it.
  This is a testing device; the public wrappers always pass False.
  """
  out_shape = list(out_shape)
  out_specs = list(out_specs)
  in_specs = list(in_specs)
  n_out = len(out_shape)

  def call(*args):
    n_in = len(args)
    if poison:
      fills = [jnp.full(s.shape, poison_value(s.dtype), s.dtype)
               for s in out_shape]

      def body(*refs):
        kernel(*refs[:n_in], *refs[n_in + n_out:])

      f = pl.pallas_call(
          body, out_shape=out_shape, grid=grid,
          in_specs=in_specs + out_specs, out_specs=out_specs,
          input_output_aliases={n_in + i: i for i in range(n_out)},
          compiler_params=triton_params(num_warps, num_stages),
          interpret=interpret, name=name)
      return list(f(*args, *fills))
    f = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret, name=name)
    return list(f(*args))

  return call


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def target_device() -> jax.Device:
  """The device a computation is built for: the default device where one is set (`with
  jax.default_device(...)`, or a compile-only GPU in a deviceless compile: kernels/aot.py),
  else jax's first. (jax.default_backend() says only what jax's first device is: a step put on
  the CPU of a GPU host is still built for the CPU.)"""
  dev = jax.config.jax_default_device or jax.devices()[0]
  return jax.devices(dev)[0] if not isinstance(dev, jax.Device) else dev


def interpret_default() -> bool:
  """Whether a caller that does not choose should run the kernels in Pallas
  interpret mode: yes unless jax's default backend is a GPU (on CPU the
  kernels then run, slowly and exactly, as jnp). The one rule for
  `s24jax.sparse_ops` and `s24jax.nn.act_sparsity`. A deviceless GPU compile
  (`kernels.compile_check`) traces with the CPU backend and must pass
  interpret=False itself.
  """
  return not on_gpu()
