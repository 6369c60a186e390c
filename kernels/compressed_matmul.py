"""y = x @ W~^T from the compressed 2:4 operand (values + metadata).

Why: no Pallas backend on Ampere or Hopper reaches the sparse tensor-core
instruction (docs/kernels.md, "What each GPU generation can get"), so this
kernel cannot halve the FLOPs. What it can do
is read ~56% of the weight bytes (half the values plus 4 bits per group of
four) and expand each tile on chip before a dense MMA. That only pays where
the matmul is bound by reading the weight, i.e. small token counts (decode,
small micro-batches); see `should_use_pallas_matmul`. For compute-bound
training GEMMs the dense XLA matmul (or, on Blackwell, `kernels.tcgen05`) is
the right path.

(Over 400 lines, one module on purpose: the forward kernel, the two backward
kernels and the custom_vjp that pairs them share the tiling and the
expansion, and apart the backward would drift from the forward it
differentiates. The family's benchmark rows close the file, as in every
kernel file.)

How the tile is expanded: instead of interleaving the four in-group
positions back into a dense [BN, BK] tile (a register shuffle), the kernel
keeps them apart. For position j it builds d_j [BN, BK/4] with
d_j[:, q] = W~[:, 4q + j] (two selects from the unpacked metadata) and loads
the matching strided slice x_j = x[:, 4q + j]; then
y += sum_j x_j @ d_j^T. Same FLOPs as one dense dot, no gather, no shuffle.

Differentiation (custom_vjp), w.r.t. x and values; meta is integer and gets
no cotangent:
  dx      = dy @ W~                 (`_dx_kernel`: the transposed expansion of
                                     the same compressed operand, no W~^T copy)
  dvalues = (dy^T x) sampled at the kept positions
            dvalues[n, 2g + s] = sum_m dy[m, n] x[m, 4g + i_s(n, g)]
                                    (`_dvalues_kernel`, an SDDMM that never
                                     forms the dense dW)
The gradient with respect to the *dense latent* weight (STE and friends) is
the sparsity method's business (`s24jax/methods/`, e.g. `ste.py`,
`s_ste.py`): scatter dvalues, or use dy^T x directly.
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
from . import bench_harness
from .sparsify24 import compress24_reference

# Token count up to which the compressed Pallas matmul is expected to beat
# the dense XLA matmul on H100 (bf16). From the roofline, not a measurement:
# a dense [T, K] x [K, N] bf16 GEMM has arithmetic intensity ~T FLOP/byte
# (weights dominate the bytes), the H100 SXM ridge is 989e12 / 3.35e12 ~ 295
# FLOP/byte (datasheet peaks, see kernels/BENCHMARKS.md), and
# the compressed operand moves 0.5625x the weight bytes; after the on-chip
# expansion overhead a win is plausible up to a few tens of tokens. 64 is a
# placeholder until `python -m s24jax.kernels.bench` calibrates it on the GPU host
# (see kernels/BENCHMARKS.md).
PALLAS_MATMUL_MAX_TOKENS = 64
# Shape constraints of the native kernel (no padding of the weight needed).
_MIN_BLOCK_K = 64   # BK/4 >= 16, the smallest MMA K
_MIN_BLOCK_N = 16


def should_use_pallas_matmul(tokens: int, out_features: int,
                             in_features: int, *,
                             backend: str | None = None) -> bool:
  """Whether `sparse24_matmul` is expected to beat the dense XLA matmul.

  True only on a GPU backend, for token counts <= PALLAS_MATMUL_MAX_TOKENS
  (the memory-bound regime, uncalibrated: see the constant), and when the
  weight needs no padding (in_features % 64 == 0, out_features % 16 == 0).
  """
  backend = backend or jax.default_backend()
  return (backend == "gpu" and 0 < tokens <= PALLAS_MATMUL_MAX_TOKENS
          and in_features % _MIN_BLOCK_K == 0
          and out_features % _MIN_BLOCK_N == 0)


@dataclasses.dataclass(frozen=True)
class Sparse24MatmulConfig(c.BlockConfig):
  """Tiles (powers of two). block_k >= 64 so every per-position dot has
  K = block_k / 4 >= 16; block_m, block_n >= 16 on GPU (MMA minimum)."""
  WORD_ALIGNED = ("block_k", "bwd_block_k")
  block_m: int = 16
  block_n: int = 64
  block_k: int = 128
  # Backward tiles (dx: [block_m, block_k] outputs, loop over N;
  # dvalues: [block_n, block_k] outputs, loop over M).
  bwd_block_m: int = 32
  bwd_block_n: int = 64
  bwd_block_k: int = 64
  num_stages: int = dataclasses.field(default=2, kw_only=True)


def _dot_nt(a, b):
  """a [m, k] @ b[n, k]^T in f32."""
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                         preferred_element_type=jnp.float32)


def _dot_nn(a, b):
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                         preferred_element_type=jnp.float32)


def _dot_tn(a, b):
  """a[k, m]^T @ b[k, n] in f32."""
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=prec,
                         preferred_element_type=jnp.float32)


def _expand(values_ref, meta_ref, rows, col0, bk):
  """Per-position dense slices d_j [rows, bk/4] of the compressed tile.

  `rows` indexes the first axis of the refs; columns are the bk dense
  columns starting at dense column col0 (a multiple of bk).
  """
  g = bk // 4
  v0 = values_ref[rows, pl.ds(col0 // 2, g, stride=2)]
  v1 = values_ref[rows, pl.ds(col0 // 2 + 1, g, stride=2)]
  words = meta_ref[rows, pl.ds(col0 // c.COLS_PER_WORD, bk // c.COLS_PER_WORD)]
  return c.expand_positions(v0, v1, c.unpack_nibbles(words))


def _fwd_kernel(x_ref, values_ref, meta_ref, y_ref, *, bm, bn, bk):
  k_total = x_ref.shape[1]
  g = bk // 4

  def body(kk, acc):
    col0 = pl.multiple_of(kk * bk, bk)
    d = _expand(values_ref, meta_ref, slice(None), col0, bk)
    for j in range(4):
      xj = x_ref[:, pl.ds(col0 + j, g, stride=4)]
      acc += _dot_nt(xj, d[j].astype(xj.dtype))
    return acc

  acc = lax.fori_loop(0, k_total // bk, body, jnp.zeros((bm, bn), jnp.float32))
  y_ref[...] = acc.astype(y_ref.dtype)


def _dx_kernel(dy_ref, values_ref, meta_ref, dx_ref, *, bm, bn, bk):
  n_total = dy_ref.shape[1]
  g = bk // 4

  def body(nn, accs):
    n0 = pl.multiple_of(nn * bn, bn)
    dy = dy_ref[:, pl.ds(n0, bn)]
    d = _expand(values_ref, meta_ref, pl.ds(n0, bn), 0, bk)
    return tuple(acc + _dot_nn(dy, d[j].astype(dy.dtype))
                 for j, acc in enumerate(accs))

  zeros = jnp.zeros((bm, g), jnp.float32)
  accs = lax.fori_loop(0, n_total // bn, body, (zeros,) * 4)
  for j in range(4):
    dx_ref[:, pl.ds(j, g, stride=4)] = accs[j].astype(dx_ref.dtype)


def _dvalues_kernel(x_ref, dy_ref, meta_ref, dv_ref, *, bm, bn, bk):
  m_total = x_ref.shape[0]
  g = bk // 4

  def body(mm, accs):
    m0 = pl.multiple_of(mm * bm, bm)
    dy = dy_ref[pl.ds(m0, bm), :]
    return tuple(
        acc + _dot_tn(dy, x_ref[pl.ds(m0, bm), pl.ds(j, g, stride=4)])
        for j, acc in enumerate(accs))

  zeros = jnp.zeros((bn, g), jnp.float32)
  accs = lax.fori_loop(0, m_total // bm, body, (zeros,) * 4)
  nib = c.unpack_nibbles(meta_ref[...])
  i0, i1 = nib & 3, (nib >> 2) & 3
  dv0 = jnp.zeros_like(accs[0])
  dv1 = jnp.zeros_like(accs[0])
  for j in range(4):
    dv0 = jnp.where(i0 == j, accs[j], dv0)
    dv1 = jnp.where(i1 == j, accs[j], dv1)
  dv_ref[:, pl.ds(0, g, stride=2)] = dv0.astype(dv_ref.dtype)
  dv_ref[:, pl.ds(1, g, stride=2)] = dv1.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------
# Launchers on 2-D, unpadded operands; they pad internally.
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Tiles:
  """Blocks (bm, bn, bk) of an [m, k] x [n, k]^T product and the padded sizes
  (mp, np_, kp): every axis padded to whole blocks, padding is zero."""
  bm: int
  bn: int
  bk: int
  mp: int
  np_: int
  kp: int

  @classmethod
  def of(cls, m, n, k, bm, bn, bk):
    bk, _ = c.fit_block(k, max(bk, _MIN_BLOCK_K), minimum=_MIN_BLOCK_K)
    bn, _ = c.fit_block(n, max(bn, _MIN_BLOCK_N), minimum=_MIN_BLOCK_N)
    bm = min(bm, max(16, pl.next_power_of_2(m)))
    up = lambda d, b: -(-d // b) * b
    return cls(bm, bn, bk, up(m, bm), up(n, bn), up(k, bk))

  @staticmethod
  def pad2(a, rows, cols):
    return c.pad_axis(c.pad_axis(a, 1, cols), 0, rows)

  def compressed(self, values, meta):
    """The compressed operand padded to [np_, kp/2] / [np_, kp/32]."""
    return (self.pad2(values, self.np_, self.kp // 2),
            self.pad2(meta, self.np_, self.kp // c.COLS_PER_WORD))


def _forward(x, values, meta, config, interpret, poison):
  m, k = x.shape
  n = values.shape[0]
  t = _Tiles.of(m, n, k, config.block_m, config.block_n, config.block_k)
  (y,) = c.pallas_call(
      functools.partial(_fwd_kernel, bm=t.bm, bn=t.bn, bk=t.bk),
      out_shape=[jax.ShapeDtypeStruct((t.mp, t.np_), x.dtype)],
      grid=(t.mp // t.bm, t.np_ // t.bn),
      in_specs=[pl.BlockSpec((t.bm, t.kp), lambda i, j: (i, 0)),
                pl.BlockSpec((t.bn, t.kp // 2), lambda i, j: (j, 0)),
                pl.BlockSpec((t.bn, t.kp // c.COLS_PER_WORD),
                             lambda i, j: (j, 0))],
      out_specs=[pl.BlockSpec((t.bm, t.bn), lambda i, j: (i, j))],
      num_warps=config.num_warps, num_stages=config.num_stages,
      interpret=interpret, poison=poison, name="sparse24_matmul_fwd",
  )(t.pad2(x, t.mp, t.kp), *t.compressed(values, meta))
  return y[:m, :n]


def _backward_dx(dy, values, meta, k, config, interpret, poison):
  m, n = dy.shape
  t = _Tiles.of(m, n, k, config.bwd_block_m, config.bwd_block_n,
                config.bwd_block_k)
  (dx,) = c.pallas_call(
      functools.partial(_dx_kernel, bm=t.bm, bn=t.bn, bk=t.bk),
      out_shape=[jax.ShapeDtypeStruct((t.mp, t.kp), dy.dtype)],
      grid=(t.mp // t.bm, t.kp // t.bk),
      in_specs=[pl.BlockSpec((t.bm, t.np_), lambda i, j: (i, 0)),
                pl.BlockSpec((t.np_, t.bk // 2), lambda i, j: (0, j)),
                pl.BlockSpec((t.np_, t.bk // c.COLS_PER_WORD),
                             lambda i, j: (0, j))],
      out_specs=[pl.BlockSpec((t.bm, t.bk), lambda i, j: (i, j))],
      num_warps=config.num_warps, num_stages=config.num_stages,
      interpret=interpret, poison=poison, name="sparse24_matmul_dx",
  )(t.pad2(dy, t.mp, t.np_), *t.compressed(values, meta))
  return dx[:m, :k]


def _backward_dvalues(x, dy, meta, config, interpret, poison, dtype):
  m, k = x.shape
  n = dy.shape[1]
  t = _Tiles.of(m, n, k, config.bwd_block_m, config.bwd_block_n,
                config.bwd_block_k)
  (dv,) = c.pallas_call(
      functools.partial(_dvalues_kernel, bm=t.bm, bn=t.bn, bk=t.bk),
      out_shape=[jax.ShapeDtypeStruct((t.np_, t.kp // 2), dtype)],
      grid=(t.np_ // t.bn, t.kp // t.bk),
      in_specs=[pl.BlockSpec((t.mp, t.bk), lambda i, j: (0, j)),
                pl.BlockSpec((t.mp, t.bn), lambda i, j: (0, i)),
                pl.BlockSpec((t.bn, t.bk // c.COLS_PER_WORD),
                             lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((t.bn, t.bk // 2), lambda i, j: (i, j))],
      num_warps=config.num_warps, num_stages=config.num_stages,
      interpret=interpret, poison=poison, name="sparse24_matmul_dvalues",
  )(t.pad2(x, t.mp, t.kp), t.pad2(dy, t.mp, t.np_),
    t.pad2(meta, t.np_, t.kp // c.COLS_PER_WORD))
  return dv[:n, :k // 2]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _matmul2d(x, values, meta, config, interpret, poison):
  return _forward(x, values, meta, config, interpret, poison)


def _matmul2d_fwd(x, values, meta, config, interpret, poison):
  return (_forward(x, values, meta, config, interpret, poison),
          (x, values, meta))


def _matmul2d_bwd(config, interpret, poison, res, dy):
  x, values, meta = res
  dy = dy.astype(x.dtype)
  dx = _backward_dx(dy, values, meta, x.shape[1], config, interpret, poison)
  dv = _backward_dvalues(x, dy, meta, config, interpret, poison, values.dtype)
  # meta is an integer input: its cotangent is the float0 zero.
  dmeta = np.zeros(meta.shape, dtype=jax.dtypes.float0)
  return dx, dv, dmeta


_matmul2d.defvjp(_matmul2d_fwd, _matmul2d_bwd)


def _check(x, values, meta):
  if values.ndim != 2 or meta.ndim != 2:
    raise ValueError("values and meta must be 2-D ([N, K/2], [N, ceil(K/32)]); "
                     f"got {values.shape} and {meta.shape}.")
  k = 2 * values.shape[1]
  c.check_groups("the weight", k)
  if x.shape[-1] != k:
    raise ValueError(f"x's last dimension ({x.shape[-1]}) must equal the "
                     f"weight's in-features K = 2 * values.shape[1] = {k}.")
  if meta.shape != (values.shape[0], c.meta_words(k)):
    raise ValueError(f"meta shape {meta.shape} != (N, ceil(K/32)) = "
                     f"{(values.shape[0], c.meta_words(k))}.")
  if x.dtype != values.dtype:
    raise ValueError(f"x ({x.dtype}) and values ({values.dtype}) must share "
                     "a dtype.")


@functools.partial(jax.jit, static_argnames=("interpret", "config", "poison"))
def _sparse24_matmul(x, values, meta, *, interpret, config, poison=False):
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1])
  y = _matmul2d(x2, values, meta.astype(jnp.uint32), config, interpret,
                poison)
  return y.reshape(*lead, values.shape[0])


def sparse24_matmul(x: jax.Array, values: jax.Array, meta: jax.Array, *,
                    interpret: bool = False,
                    config: Sparse24MatmulConfig | None = None) -> jax.Array:
  """x [..., K] @ decompress24(values, meta).T -> [..., N], from compressed W.

  Args:
    x: activations [..., K], same dtype as values (bf16 or f32).
    values: [N, K/2] kept weight values (from `compress24`).
    meta: [N, ceil(K/32)] uint32 metadata (from `compress24`).
    interpret: run in Pallas interpret mode (CPU).
    config: tiles; default `Sparse24MatmulConfig()`.

  Differentiable w.r.t. x and values (custom_vjp, see the module docstring);
  accumulation is f32, the output has x's dtype. Shapes that do not fill a
  tile are zero-padded (tokens, K to a multiple of the K tile, N).
  """
  _check(x, values, meta)
  return _sparse24_matmul(x, values, meta, interpret=interpret,
                          config=config or Sparse24MatmulConfig())


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def _sparse24_matmul_dx(dy, values, meta, *, interpret, config):
  lead = dy.shape[:-1]
  k = 2 * values.shape[1]
  dx = _backward_dx(dy.reshape(-1, dy.shape[-1]), values, meta.astype(jnp.uint32),
                    k, config, interpret, False)
  return dx.reshape(*lead, k)


def sparse24_matmul_dx(dy: jax.Array, values: jax.Array, meta: jax.Array, *,
                       interpret: bool = False,
                       config: Sparse24MatmulConfig | None = None) -> jax.Array:
  """dy [..., N] @ decompress24(values, meta) -> [..., K]: the data gradient alone.

  The `_dx_kernel` of `sparse24_matmul`'s backward, for callers with their own
  custom_vjp that want dx from the compressed operand but a different weight
  gradient (`s24jax.sparse_ops`: the dense dy^T x that straight-through
  projections need, not dvalues). Output in dy's dtype, f32 accumulation.
  """
  if values.ndim != 2 or meta.ndim != 2:
    raise ValueError("values and meta must be 2-D ([N, K/2], [N, ceil(K/32)]); "
                     f"got {values.shape} and {meta.shape}.")
  if dy.shape[-1] != values.shape[0]:
    raise ValueError(f"dy's last dimension ({dy.shape[-1]}) must equal the "
                     f"weight's out-features N = values.shape[0] = {values.shape[0]}.")
  return _sparse24_matmul_dx(dy, values, meta, interpret=interpret,
                             config=config or Sparse24MatmulConfig())


def sparse24_matmul_reference(x, values, meta):
  """Plain XLA reference: decompress, then a dense matmul (f32 accumulate)."""
  w = c.decompress(values, meta)
  prec = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  y = jnp.einsum("...k,nk->...n", x, w, precision=prec,
                 preferred_element_type=jnp.float32)
  return y.astype(x.dtype)


# ----------------------------------------------------------------------------
# Benchmark rows (python -m s24jax.kernels.bench; kernels/bench_harness.py).
# ----------------------------------------------------------------------------
def bench_operands(t, n, k, dtype):
  """x (t, k), a 2:4 W~ (n, k) compressed (values, meta), and W~ dense."""
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (t, k), dtype)
  values, meta = compress24_reference(jax.random.normal(kw, (n, k), dtype))
  return x, values, meta, c.decompress(values, meta)


def _bench_matmul(shapes, dtype, interpret, reps):
  for t, n, k in shapes:
    x, values, meta, dense = bench_operands(t, n, k, dtype)
    fast = jax.jit(functools.partial(sparse24_matmul, interpret=interpret))
    nbytes = (values.size * values.dtype.itemsize + meta.size * 4
              + (x.size + t * n) * x.dtype.itemsize)
    yield bench_harness.row("sparse24_matmul", (t, n, k),
                     bench_harness.time_fn(fast, x, values, meta, reps=reps),
                     bench_harness.time_fn(jax.jit(bench_harness.dense_mm), x, dense, reps=reps),
                     nbytes=nbytes, flops=2 * t * n * k,
                     note=f"use_pallas={should_use_pallas_matmul(t, n, k)}")


def _bench_matmul_bwd(shapes, dtype, interpret, reps):
  for t, n, k in shapes:
    x, values, meta, dense = bench_operands(t, n, k, dtype)
    dy = jax.random.normal(jax.random.key(1), (t, n), dtype)
    fast = jax.jit(lambda x, v, dy: jax.vjp(
        lambda x, v: sparse24_matmul(x, v, meta, interpret=interpret), x, v)[1](dy))
    ref = jax.jit(lambda x, w, dy: jax.vjp(bench_harness.dense_mm, x, w)[1](dy))
    yield bench_harness.row("sparse24_matmul_bwd(dx,dvalues)", (t, n, k),
                     bench_harness.time_fn(fast, x, values, dy, reps=reps),
                     bench_harness.time_fn(ref, x, dense, dy, reps=reps), flops=4 * t * n * k,
                     note="xla: dense dx, dW")


BENCHMARKS = {"matmul": _bench_matmul, "matmul_bwd": _bench_matmul_bwd}


if __name__ == "__main__":   # this family's rows of python -m s24jax.kernels.bench
  raise SystemExit(bench_harness.main(
      BENCHMARKS, prog="python -m s24jax.kernels.compressed_matmul",
      description="Benchmark sparse24_matmul (forward; backward dx, dvalues) against XLA."))
