"""Fused 2:4 sparsify + compress: W -> (values [rows, K/2], meta) in one pass.

Why a kernel: every training step re-projects the dense latent weight onto a
2:4 pattern and the fast matmul wants it compressed. Doing mask, select and
pack in one read of W (and one write of ~56% of its bytes) beats the XLA
chain mask -> where -> gather -> pack, which materialises the dense mask and
the dense masked weight in between.

Variants (`mode`):
  * "hard": keep the two largest |w| of every group of four, ties to the
    lower index (exactly `s24jax.kernels.masks.nm_mask`); values are w at those spots.
  * "mask": positions from a given boolean 2:4 mask (at most two per group;
    a group with fewer is topped up with zero-valued slots).
  * "soft": S-STE soft threshold, values = beta * sign(w) * max(|w| - t, 0)
    with t the second-smallest |w| of the group, kept at the positions of the
    two largest |w| (the others are exactly zero after the threshold).

The compressed format (values + 2-bit position metadata, 8 groups per uint32
word) is documented in `kernels/_common.py`; `decompress24` inverts it.
None of these functions is differentiable (the metadata is integer); the
training-time projections with their straight-through rules are the sparsity
methods of `s24jax/methods/` (e.g. `ste.py`, `s_ste.py`), which can call
`compress24` on their forward value.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from . import _common as c
from . import masks
from . import bench_harness

MODES = ("hard", "mask", "soft")


@dataclasses.dataclass(frozen=True)
class Sparsify24Config(c.BlockConfig):
  """Block sizes for the sparsify kernel (powers of two).

  block_rows x block_cols is one program's tile of W; block_cols >= 32 so a
  tile holds whole metadata words. Wide tiles keep the per-row stores long.
  """
  WORD_ALIGNED = ("block_cols",)
  block_rows: int = 16
  block_cols: int = 256


def _sparsify24_kernel(*refs, mode: str, block_cols: int):
  if mode == "mask":
    w_ref, mask_ref, values_ref, meta_ref = refs
  elif mode == "soft":
    w_ref, beta_ref, values_ref, meta_ref = refs
  else:
    w_ref, values_ref, meta_ref = refs
  g = block_cols // 4
  # One strided load per in-group position: a_j[:, q] = w[:, 4q + j]. The
  # four loads touch the same cache lines, so DRAM traffic is one read of W.
  a = [w_ref[:, pl.ds(j, g, stride=4)] for j in range(4)]
  if mode == "mask":
    keep = [mask_ref[:, pl.ds(j, g, stride=4)] for j in range(4)]
    sel = c.select_two(keep)
    vals = [jnp.where(keep[j], a[j], jnp.zeros_like(a[j])) for j in range(4)]
  else:
    mags = [jnp.abs(x) for x in a]
    sel = c.top2_of4(mags)
    if mode == "soft":
      f = [m.astype(jnp.float32) for m in mags]
      zero = jnp.zeros_like(f[0])
      # t = second-smallest |w| = the larger of the two dropped magnitudes.
      t = jnp.maximum(
          jnp.maximum(jnp.where(sel[0], zero, f[0]), jnp.where(sel[1], zero, f[1])),
          jnp.maximum(jnp.where(sel[2], zero, f[2]), jnp.where(sel[3], zero, f[3])))
      beta = beta_ref[0]
      vals = [(beta * jnp.sign(a[j].astype(jnp.float32))
               * jnp.maximum(f[j] - t, 0.0)).astype(a[j].dtype)
              for j in range(4)]
    else:
      vals = a
  i0, i1, v0, v1 = c.slots_from_selection(sel, vals)
  values_ref[:, pl.ds(0, g, stride=2)] = v0.astype(values_ref.dtype)
  values_ref[:, pl.ds(1, g, stride=2)] = v1.astype(values_ref.dtype)
  meta_ref[...] = c.pack_nibbles(c.nibble(i0, i1))


@functools.partial(
    jax.jit, static_argnames=("mode", "config", "interpret", "poison"))
def _sparsify24(w, mask, beta, *, mode: str, config: Sparsify24Config,
                interpret: bool, poison: bool = False):
  """Internal entry: w [..., K] -> (values [..., K/2], meta [..., ceil(K/32)])."""
  t = c.RowTiling.of(w.shape, config.block_rows, config.block_cols)
  args, in_specs = [t.pad(w)], [t.in_spec()]
  if mode == "mask":
    args.append(t.pad(mask.astype(jnp.bool_), False))
    in_specs.append(t.in_spec())
  elif mode == "soft":
    args.append(jnp.asarray(beta, jnp.float32).reshape(1))
    in_specs.append(pl.BlockSpec((1,), lambda i, j: (0,)))
  out_shape, out_specs = t.compressed_outputs(w.dtype)
  values, meta = c.pallas_call(
      functools.partial(_sparsify24_kernel, mode=mode, block_cols=t.bc),
      out_shape=out_shape, grid=t.grid, in_specs=in_specs,
      out_specs=out_specs, num_warps=config.num_warps,
      num_stages=config.num_stages, interpret=interpret, poison=poison,
      name=f"sparsify24_{mode}",
  )(*args)
  return t.unpad_compressed(values, meta)


def _check_mask(w, mask):
  if mask.shape != w.shape:
    raise ValueError(f"mask shape {mask.shape} != w shape {w.shape}.")
  try:
    m = np.asarray(mask).astype(bool)
  except (jax.errors.TracerArrayConversionError,
          jax.errors.ConcretizationTypeError):
    return  # Under jit: documented "two lowest-indexed kept" behaviour.
  counts = m.reshape(*m.shape[:-1], m.shape[-1] // 4, 4).sum(-1)
  if counts.max(initial=0) > 2:
    bad = np.argwhere(counts > 2)[0]
    raise ValueError(
        "mask is not 2:4: group "
        f"{tuple(int(i) for i in bad)} (along the last axis) keeps "
        f"{int(counts[tuple(bad)])} of 4 entries.")


def compress24(w: jax.Array, mask: jax.Array | None = None, *,
               interpret: bool = False,
               config: Sparsify24Config | None = None):
  """Compresses w [..., K] to 2:4 (values [..., K/2], meta [..., ceil(K/32)]).

  Args:
    w: floating array, K = w.shape[-1] a multiple of 4 (groups run along the
      last axis, the contraction axis of y = x W^T).
    mask: optional boolean mask of w's shape with at most two True per group
      (checked when concrete; under jit extra entries are dropped, keeping
      the two lowest-indexed). None: hard threshold, the two largest |w| of
      each group, ties to the lower index.
    interpret: run the Pallas kernel in interpret mode (CPU).
    config: block sizes; default `Sparsify24Config()`.

  Returns:
    (values, meta): values has w's dtype, meta is uint32; see
    `kernels/_common.py` for the format.
  """
  c.check_float_groups("w", w)
  config = config or Sparsify24Config()
  if mask is None:
    return _sparsify24(w, None, None, mode="hard", config=config,
                       interpret=interpret)
  _check_mask(w, mask)
  return _sparsify24(w, mask, None, mode="mask", config=config,
                     interpret=interpret)


def soft_compress24(w: jax.Array, beta: float | jax.Array = 1.0, *,
                    interpret: bool = False,
                    config: Sparsify24Config | None = None):
  """S-STE soft threshold fused with compression.

  values = beta * sign(w) * max(|w| - t, 0), t = second-smallest |w| of the
  group, at the positions of the two largest |w| (ties to the lower index).
  `beta` is a runtime scalar (the fixed per-tensor S-STE scale), so changing
  it does not recompile.
  """
  c.check_float_groups("w", w)
  return _sparsify24(w, None, beta, mode="soft",
                     config=config or Sparsify24Config(), interpret=interpret)


def decompress24(values: jax.Array, meta: jax.Array) -> jax.Array:
  """(values [..., K/2], meta [..., ceil(K/32)]) -> dense 2:4 array [..., K].

  Plain XLA (a broadcast, shifts and selects): it is cheap, runs everywhere
  and is differentiable with respect to `values`.
  """
  return c.decompress(values, meta)


# ----------------------------------------------------------------------------
# References (plain jnp).
# ----------------------------------------------------------------------------
def compress24_reference(w: jax.Array, mask: jax.Array | None = None):
  """jnp reference of `compress24` (same format, same tie rule).

  The hard-threshold positions come from `s24jax.kernels.masks.nm_mask` (the
  project's one implementation of the 2:4 mask), not from the kernel's own
  `top2_of4`, so the tests check the kernel's tie rule against it.
  """
  c.check_float_groups("w", w)
  if mask is None:
    mask = masks.nm_mask(w)
  return c.compress_from_keep(w, c.split_positions(mask.astype(jnp.bool_)))


def soft_threshold24_reference(w: jax.Array, beta=1.0) -> jax.Array:
  """Dense beta * S(w) (S-STE soft threshold, `masks.soft_threshold24`) in float32, cast back."""
  c.check_float_groups("w", w)
  s = masks.soft_threshold24(w.astype(jnp.float32))
  return (jnp.asarray(beta, jnp.float32) * s).astype(w.dtype)


def soft_compress24_reference(w: jax.Array, beta=1.0):
  """jnp reference of `soft_compress24` (positions from `masks.nm_mask`)."""
  keep = c.split_positions(masks.nm_mask(w))
  parts = c.split_positions(soft_threshold24_reference(w, beta))
  i0, i1, v0, v1 = c.slots_from_selection(keep, parts)
  return c.interleave([v0, v1]), c.pack_meta_rows(c.nibble(i0, i1))


# ----------------------------------------------------------------------------
# Benchmark rows (python -m s24jax.kernels.bench; kernels/bench_harness.py).
# ----------------------------------------------------------------------------
def _bench_sparsify24(shapes, dtype, interpret, reps):
  for n, k in shapes:
    w = jax.random.normal(jax.random.key(0), (n, k), dtype)
    nbytes = w.size * w.dtype.itemsize * 1.5 + w.size // 8
    for name, fast, ref in [
        ("sparsify24_hard", functools.partial(compress24, interpret=interpret),
         jax.jit(compress24_reference)),
        ("sparsify24_soft",
         functools.partial(soft_compress24, beta=0.9, interpret=interpret),
         jax.jit(functools.partial(soft_compress24_reference, beta=0.9)))]:
      yield bench_harness.row(name, (n, k), bench_harness.time_fn(fast, w, reps=reps),
                       bench_harness.time_fn(ref, w, reps=reps), nbytes=nbytes)


BENCHMARKS = {"sparsify24": _bench_sparsify24}


if __name__ == "__main__":   # this family's rows of python -m s24jax.kernels.bench
  raise SystemExit(bench_harness.main(
      BENCHMARKS, prog="python -m s24jax.kernels.sparsify24",
      description="Benchmark compress24 / soft_compress24 against XLA."))
