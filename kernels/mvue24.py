"""MVUE 2:4: the unbiased stochastic 2:4 estimator, fused with compression.

Why: the fully sparse linear layer computes dW = MVUE(dY^T) x with dY^T made
2:4 along tokens (docs/algorithms.md, "MVUE 2:4 estimator"). The
estimator is elementwise per group of four, so one pass that reads the dense
input once and writes compressed values + metadata is all the memory traffic
there is. (`s24jax.kernels.masks.mvue24` is the same estimator with jax.random draws;
this kernel uses its own counter-based hash, so the two agree in law, not
draw for draw.)

Estimator (per group x_0..x_3): a_i = |x_i| + eps, S = sum a_i. Draw a first
index with probability a_i / S, then a second from the other three with
probability proportional to a_j. Keep the two drawn entries as x_i / p_i with
p_i = a_i/S + sum_{j != i} (a_j/S) * a_i/(S - a_j), the inclusion
probability; E[result] = x exactly. eps follows `s24jax.kernels.masks.mvue24`'s rule, one rule
for both: eps = MVUE_REL_EPS * max_j |x_j| + the smallest normal float32, per group
(scale-invariant; it affects the variance, never the mean).

Randomness: `pltpu.prng_*` is TPU only and the Triton backend has no RNG
primitive, so draws come from a counter-based hash: for global group index
g = row * (K/4) + group_in_row and draw d in {0, 1},
  h = mix(mix((2g + d) ^ H(seed)) + H(seed)),  u = (h >> 8) * 2^-24 in [0, 1)
with mix/H the "lowbias32" 32-bit integer hash (Wellons). Everything is
uint32 with wrap-around, so the kernel and the jnp reference (which share
`_mvue_group` and `_uniform`) produce the same draws bit for bit from the
same seed, independent of the tile sizes. Counters wrap after 2^31 groups
(2^33 entries), far beyond one gradient tensor here.

Inverse-CDF sampling uses explicit left-to-right cumulative sums so the
comparisons are reproducible; a rounding of u * S up to S can only select the
already-drawn index in one case (first = 3), which is mapped to index 2.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from . import _common as c
from . import masks
from . import bench_harness



@dataclasses.dataclass(frozen=True)
class Mvue24Config(c.BlockConfig):
  """One program's tile of x (powers of two; block_cols >= 32)."""
  WORD_ALIGNED = ("block_cols",)
  block_rows: int = 16
  block_cols: int = 256


def _mix(x):
  """lowbias32: a good 32-bit integer bijection (xor-shift-multiply)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def _uniform(seed_hash, counter):
  """U[0, 1) float32 from uint32 (hashed seed, counter); 24 random bits."""
  h = _mix(_mix(counter ^ seed_hash) + seed_hash)
  return (h >> 8).astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0**-24)


def seed_hash(seed):
  return _mix(jnp.asarray(seed, jnp.uint32) ^ jnp.uint32(0x9E3779B9))


def seed_from_key(key: jax.Array) -> jax.Array:
  """A uint32 seed from a JAX PRNG key (for callers holding keys)."""
  return jax.random.bits(key, (), jnp.uint32)


def _draw(w, u):
  """Inverse-CDF draw of an index in 0..3 with probability w_i / sum(w), by
  explicit left-to-right cumulative sums (reproducible comparisons).
  Returns (index int32, sum(w))."""
  c0 = w[0]
  c1 = c0 + w[1]
  c2 = c1 + w[2]
  total = c2 + w[3]
  t = u * total
  idx = ((t >= c0).astype(jnp.int32) + (t >= c1).astype(jnp.int32)
         + (t >= c2).astype(jnp.int32))
  return idx, total


def _weights(xf):
  """a_i = |x_i| + eps, eps = MVUE_REL_EPS * max_j |x_j| + tiny: masks.mvue24's rule."""
  a = [jnp.abs(v) for v in xf]
  eps = (jnp.float32(masks.MVUE_REL_EPS) * jnp.maximum(jnp.maximum(a[0], a[1]),
                                                        jnp.maximum(a[2], a[3]))
         + jnp.float32(masks.MVUE_TINY))
  return [v + eps for v in a]


def _mvue_group(x, u1, u2):
  """Per-position inputs x[0..3] (any float) -> (i0, i1, v0, v1), i0 < i1.

  Shared by the kernel and the reference so both do the same float ops in
  the same order.
  """
  xf = [v.astype(jnp.float32) for v in x]
  a = _weights(xf)
  first, s = _draw(a, u1)
  zero = jnp.zeros_like(a[0])
  second, _ = _draw([jnp.where(first == j, zero, a[j]) for j in range(4)], u2)
  second = jnp.where(second == first, jnp.where(first == 3, 2, 3), second)
  # Inclusion probabilities; S - a_j as the sum of the other three (no
  # cancellation).
  others = [(a[1] + a[2]) + a[3], (a[0] + a[2]) + a[3],
            (a[0] + a[1]) + a[3], (a[0] + a[1]) + a[2]]
  q = [a[j] / s for j in range(4)]
  p = []
  for i in range(4):
    acc = q[i]
    for j in range(4):
      if j != i:
        acc = acc + q[j] * (a[i] / others[j])
    p.append(acc)
  est = [xf[j] / p[j] for j in range(4)]
  lo = jnp.minimum(first, second)
  hi = jnp.maximum(first, second)
  v0 = jnp.where(lo == 0, est[0], jnp.where(lo == 1, est[1], est[2]))
  v1 = jnp.where(hi == 3, est[3], jnp.where(hi == 2, est[2], est[1]))
  return lo.astype(jnp.uint32), hi.astype(jnp.uint32), v0, v1


def _mvue_kernel(x_ref, seed_ref, values_ref, meta_ref, *, br, bk, groups):
  g = bk // 4
  x = [x_ref[:, pl.ds(j, g, stride=4)] for j in range(4)]
  row = (pl.program_id(0) * br
         + lax.broadcasted_iota(jnp.int32, (br, g), 0)).astype(jnp.uint32)
  col = (pl.program_id(1) * g
         + lax.broadcasted_iota(jnp.int32, (br, g), 1)).astype(jnp.uint32)
  counter = (row * jnp.uint32(groups) + col) * jnp.uint32(2)
  sh = seed_hash(seed_ref[0])
  u1 = _uniform(sh, counter)
  u2 = _uniform(sh, counter + jnp.uint32(1))
  i0, i1, v0, v1 = _mvue_group(x, u1, u2)
  nib = jnp.where(col < groups, c.nibble(i0, i1), jnp.uint32(c.EMPTY_NIBBLE))
  values_ref[:, pl.ds(0, g, stride=2)] = v0.astype(values_ref.dtype)
  values_ref[:, pl.ds(1, g, stride=2)] = v1.astype(values_ref.dtype)
  meta_ref[...] = c.pack_nibbles(nib)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "poison"))
def _mvue24(x, seed, *, config, interpret, poison=False):
  t = c.RowTiling.of(x.shape, config.block_rows, config.block_cols)
  out_shape, out_specs = t.compressed_outputs(x.dtype)
  values, meta = c.pallas_call(
      functools.partial(_mvue_kernel, br=t.br, bk=t.bc, groups=t.k // 4),
      out_shape=out_shape, grid=t.grid,
      in_specs=[t.in_spec(), pl.BlockSpec((1,), lambda i, j: (0,))],
      out_specs=out_specs, num_warps=config.num_warps,
      num_stages=config.num_stages, interpret=interpret, poison=poison,
      name="mvue24",
  )(t.pad(x), jnp.asarray(seed, jnp.uint32).reshape(1))
  return t.unpad_compressed(values, meta)


def mvue24_compress(x: jax.Array, seed, *, interpret: bool = False,
                    config: Mvue24Config | None = None):
  """Unbiased stochastic 2:4 estimate of x [..., K], compressed.

  Args:
    x: floating array; groups of four run along the last axis (transpose
      dY to [out, tokens] first for the dW = MVUE(dY^T) x use).
    seed: uint32 scalar (python int or array; `seed_from_key(key)` converts
      a PRNG key). Same seed -> same draws, whatever the tiles.
  Returns:
    (values [..., K/2] in x's dtype, meta [..., ceil(K/32)] uint32);
    `decompress24` gives the dense estimate, E[dense] = x.
  """
  c.check_float_groups("x", x)
  return _mvue24(x, seed, config=config or Mvue24Config(), interpret=interpret)


def mvue24_reference(x: jax.Array, seed):
  """Plain-jnp reference with the identical counter-based draws."""
  c.check_float_groups("x", x)
  k = x.shape[-1]
  parts = c.split_positions(x)
  shape = parts[0].shape
  # Global row index over all leading axes (row-major), as in the kernel.
  n_rows = int(np.prod(shape[:-1]))
  rows = jnp.arange(n_rows, dtype=jnp.uint32).reshape(*shape[:-1], 1)
  cols = jnp.arange(shape[-1], dtype=jnp.uint32)
  counter = (rows * jnp.uint32(k // 4) + cols) * jnp.uint32(2)
  sh = seed_hash(seed)
  u1 = _uniform(sh, counter)
  u2 = _uniform(sh, counter + jnp.uint32(1))
  i0, i1, v0, v1 = _mvue_group(parts, u1, u2)
  values = c.interleave([v0.astype(x.dtype), v1.astype(x.dtype)])
  return values, c.pack_meta_rows(c.nibble(i0, i1))


def mvue24_dense_reference(x: jax.Array, seed):
  return c.decompress(*mvue24_reference(x, seed))


# ----------------------------------------------------------------------------
# Benchmark rows (python -m s24jax.kernels.bench; kernels/bench_harness.py).
# ----------------------------------------------------------------------------
def _bench_mvue24(shapes, dtype, interpret, reps):
  for rows, tokens in shapes:
    x = jax.random.normal(jax.random.key(0), (rows, tokens), dtype)
    fast = jax.jit(functools.partial(mvue24_compress, interpret=interpret))
    ref = jax.jit(mvue24_reference)
    nbytes = x.size * x.dtype.itemsize * 1.5 + x.size // 8
    yield bench_harness.row("mvue24", (rows, tokens), bench_harness.time_fn(fast, x, 3, reps=reps),
                     bench_harness.time_fn(ref, x, 3, reps=reps), nbytes=nbytes)


BENCHMARKS = {"mvue24": _bench_mvue24}


if __name__ == "__main__":   # this family's rows of python -m s24jax.kernels.bench
  raise SystemExit(bench_harness.main(
      BENCHMARKS, prog="python -m s24jax.kernels.mvue24",
      description="Benchmark mvue24_compress against XLA."))
