"""2:4 sparse GEMMs on Blackwell's sparse tensor cores (`tcgen05.mma.sp`, sm_100a).

Status: compiled (devicelessly, for a B200: `python -m s24jax.kernels.compile_check --gpu b200`),
never run. No Blackwell GPU was available to this project; the numerics tests
(tests/kernels/test_tcgen05_kernels.py, marked `gpu`) are written and skip everywhere else.

What it computes: C = A~ B^T with A~ 2:4 sparse along K, given compressed, and B dense:

    sparse_matmul(a_values [M, K/2], a_meta [M, ceil(K/32)], b [N, K]) -> C [M, N]

(a_values, a_meta) are in this package's 2:4 format (`kernels/_common.py`), as
`compress24`, `transposable_mask24(with_compressed=True)` and `mvue24_compress` produce it. B
is row-major with K contiguous, which for the layer's GEMMs is the activation itself. The
sparse operand must be on the left (the hardware's A); hence the three GEMM forms of a 2:4
linear layer y = x W~^T, with x (T, in), W~ (out, in), dy (T, out):

    forward      y^T  = W~ x^T                  A = W~    compressed along in
    data grad    dX^T = W~^T dY^T                A = W~^T  compressed along out: W~^T must be
                                                 2:4 too, i.e. a transposable mask
    weight grad  dW   = MVUE(dY^T) x             A = MVUE(dY^T), compressed along the tokens

`forward`, `data_grad` and `weight_grad` below are these three, returning y, dX and dW.

How (Mosaic GPU, `jax.experimental.pallas.mosaic_gpu`): one CTA (one warpgroup) per
128 x tile_n output tile; TMA copies the compressed A tile (128 x tile_k/2), the B tile
(tile_n x tile_k) and the A metadata into a `stages`-deep shared-memory ring; the metadata
goes on to tensor memory (`async_copy_sparse_metadata_to_tmem`), and `tcgen05_mma(...,
a_sparse_metadata=...)` accumulates in f32 in tensor memory. A stage is refilled once the MMA
that read it has completed (its barrier), so up to `stages` loads are in flight while the
tensor core works. The epilogue reads the accumulator back in 64-column slices, casts, and
stores through shared memory with TMA.

The hardware's metadata: per row, per group of four along K, the two kept positions
(i0 < i1) as two 2-bit numbers, laid out by `plgpu.format_tcgen05_sparse_metadata`
(M/128, K/128, 128, 64) uint2. `tcgen05_metadata` converts this package's nibbles to it
(a nibble is i0 | i1 << 2, so the pairs are the nibbles' two halves).

Shapes: M is padded to a multiple of 128, K to a multiple of tile_k, N to a multiple of
tile_n (zero values, empty groups), and the result sliced back; so any M, and any N, K with K
a multiple of 4 (2:4 groups), are accepted. Operands bf16 or f16 (tcgen05's sparse MMA has no
f32 / tf32 kind here), f32 accumulation, output in `out_dtype` (default: the operands').
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _common as c
from . import bench_harness
from .compressed_matmul import bench_operands
from .mvue24 import mvue24_compress

BACKEND_ELSEWHERE = "xla"    # the sparse layer's backend that runs on any device
_TILE_M = 128                # tcgen05 sparse MMA: M = 128 per CTA
_META_K = 128                # dense K per (128, 64) uint2 block of formatted metadata


@dataclasses.dataclass(frozen=True)
class Tcgen05Config:
  """tile_n: output columns per CTA (64, 128 or 256; <= 256 for one MMA); tile_k: dense K
  per pipeline stage (a multiple of 128); stages: depth of the shared-memory ring;
  epilogue_n: accumulator columns read back per step."""
  tile_n: int = 128
  tile_k: int = 128
  stages: int = 3
  epilogue_n: int = 64

  def __post_init__(self):
    if self.tile_n not in (64, 128, 256):
      raise ValueError(f"tile_n={self.tile_n} must be 64, 128 or 256.")
    if self.tile_k % _META_K:
      raise ValueError(f"tile_k={self.tile_k} must be a multiple of {_META_K}.")
    # One stage would make step ki wait for a load that only step ki itself refills.
    if self.stages < 2 or self.tile_n % self.epilogue_n:
      raise ValueError("stages must be >= 2 and tile_n a multiple of epilogue_n.")


class NotBlackwellError(RuntimeError):
  """kernels.tcgen05 was asked to run somewhere other than a Blackwell GPU."""


def _plgpu():
  # Imported when a tcgen05 kernel is built, not with this module: Mosaic GPU adds ~0.3 s to
  # every import of the package, and nothing else here needs it.
  from jax.experimental.pallas import mosaic_gpu as plgpu   # pylint: disable=g-import-not-at-top
  return plgpu


# ---------------------------------------------------------------------------------------------
# Metadata: this package's nibbles -> tcgen05's formatted uint2 pairs


def metadata_pairs(meta: jax.Array, k: int) -> jax.Array:
  """meta [M, ceil(K/32)] uint32 (package format) -> [M, K/4, 2] uint8 (i0, i1) per group."""
  nib = c.unpack_nibbles(meta.astype(jnp.uint32))[..., :k // 4]
  return jnp.stack([nib & 3, (nib >> 2) & 3], axis=-1).astype(jnp.uint8)


def tcgen05_metadata(meta: jax.Array, k: int, dtype=jnp.bfloat16) -> jax.Array:
  """Package metadata [M, ceil(K/32)] -> `plgpu.format_tcgen05_sparse_metadata` layout
  (M/128, K/128, 128, 64) uint2, for operands of `dtype`. M must be a multiple of 128 and
  K of 128 (`sparse_matmul` pads before converting)."""
  m = meta.shape[0]
  if m % _TILE_M or k % _META_K:
    raise ValueError(f"tcgen05 metadata needs M % 128 == 0 and K % 128 == 0; got M={m}, "
                     f"K={k} (sparse_matmul pads for you).")
  pairs = metadata_pairs(meta, k).astype(jnp.uint2)
  return _plgpu().format_tcgen05_sparse_metadata(pairs, dtype)


# ---------------------------------------------------------------------------------------------
# Where it may run


def targets_blackwell(dev=None) -> bool:
  """Whether the target device (`c.target_device()`) is Blackwell: compute capability 10.x."""
  return str(getattr(dev or c.target_device(), "compute_capability", "")).startswith("10.")


def check_device() -> None:
  """Raises NotBlackwellError unless `targets_blackwell()`."""
  dev = c.target_device()
  if not targets_blackwell(dev):
    where = (f"a {dev.device_kind} (compute capability {dev.compute_capability})"
             if dev.platform == "gpu" else f"jax platform {dev.platform!r}")
    raise NotBlackwellError(
        f"kernels.tcgen05 (sparsity.backend='tcgen05') runs only on NVIDIA Blackwell GPUs "
        f"(sm_100a: tcgen05.mma.sp has no equivalent elsewhere); this process targets "
        f"{where}. Use sparsity.backend='{BACKEND_ELSEWHERE}', which runs on every device "
        f"(or 'pallas' on Ampere / Hopper GPUs).")


# ---------------------------------------------------------------------------------------------
# The kernel


def _swizzled(dtype):
  """SMEM tiling + swizzle for bf16/f16 MMA operands (64-byte swizzle, as jax's own sparse
  tcgen05 tests use for both operands)."""
  plgpu = _plgpu()
  swizzle = 64
  elems = 8 * swizzle // (8 * jnp.dtype(dtype).itemsize)
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _build(m, n, k, dtype, out_dtype, cfg: Tcgen05Config):
  """The pallas kernel for padded shapes (m % 128 == n % tile_n == k % tile_k == 0)."""
  plgpu = _plgpu()
  tn, tk, stages, en = cfg.tile_n, cfg.tile_k, cfg.stages, cfg.epilogue_n
  k_iters = k // tk
  stages = min(stages, k_iters)
  meta_k = tk // _META_K                      # formatted metadata blocks per stage

  def tcgen05_sparse_matmul(a_gmem, b_gmem, meta_gmem, out_gmem, a_smem, b_smem, meta_smem,
                            out_smem, acc_tmem, meta_tmem, load_bar, mma_bar, done_bar):
    mi = lax.axis_index("m")
    ni = lax.axis_index("n")
    rows = pl.ds(mi * _TILE_M, _TILE_M)
    cols = pl.ds(ni * tn, tn)

    def load(ki, s):
      bar = load_bar.at[s]
      plgpu.copy_gmem_to_smem(a_gmem.at[rows, pl.ds(ki * (tk // 2), tk // 2)],
                              a_smem.at[s], bar)
      plgpu.copy_gmem_to_smem(b_gmem.at[cols, pl.ds(ki * tk, tk)], b_smem.at[s], bar)
      plgpu.copy_gmem_to_smem(meta_gmem.at[pl.ds(mi, 1), pl.ds(ki * meta_k, meta_k)],
                              meta_smem.at[s], bar)

    for s in range(stages):                   # prologue: fill the ring
      load(s, s)

    def step(ki, s):
      """MMA number ki from stage s (static); then refill the stage the previous MMA
      read, once that MMA has completed."""
      plgpu.barrier_wait(load_bar.at[s])
      plgpu.async_copy_sparse_metadata_to_tmem(meta_smem.at[s], meta_tmem.at[s])
      plgpu.tcgen05_mma(acc_tmem, a_smem.at[s],
                        plgpu.transpose_ref(b_smem.at[s], (1, 0)), mma_bar.at[s],
                        a_sparse_metadata=meta_tmem.at[s], accumulate=ki > 0)
      prev = (s - 1) % stages

      @pl.when(jnp.logical_and(ki >= 1, ki - 1 + stages < k_iters))
      def _():
        plgpu.barrier_wait(mma_bar.at[prev])
        load(ki - 1 + stages, prev)

    def ring(r, carry):                       # one turn of the ring: static stage indices
      for s in range(stages):
        ki = r * stages + s

        @pl.when(ki < k_iters)
        def _():
          step(ki, s)
      return carry

    lax.fori_loop(0, pl.cdiv(k_iters, stages), ring, None)
    plgpu.tcgen05_commit_arrive(done_bar)     # all MMAs issued so far
    plgpu.barrier_wait(done_bar)
    for j in range(tn // en):
      sl = pl.ds(j * en, en)
      out_smem[...] = plgpu.async_load_tmem(acc_tmem.at[:, sl]).astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[rows, pl.ds(ni * tn + j * en, en)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    plgpu.wait_smem_to_gmem(0)

  op = _swizzled(dtype)
  return plgpu.kernel(
      tcgen05_sparse_matmul,
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(m // _TILE_M, n // tn),
      grid_names=("m", "n"),
      scratch_types=dict(
          a_smem=plgpu.SMEM((stages, _TILE_M, tk // 2), dtype, transforms=op),
          b_smem=plgpu.SMEM((stages, tn, tk), dtype, transforms=op),
          meta_smem=plgpu.SMEM((stages, 1, meta_k, _TILE_M, 64), jnp.uint2),
          out_smem=plgpu.SMEM((_TILE_M, en), out_dtype, transforms=_swizzled(out_dtype)),
          acc_tmem=plgpu.TMEM((_TILE_M, tn), jnp.float32),
          meta_tmem=plgpu.TMEM((stages, _TILE_M, tk // 2), jnp.uint2,
                               layout=plgpu.TMEMLayout.SPARSE_METADATA_LAYOUT),
          load_bar=plgpu.Barrier(num_arrivals=3, num_barriers=stages),
          mma_bar=plgpu.Barrier(num_barriers=stages, orders_tensor_core=True),
          done_bar=plgpu.Barrier(orders_tensor_core=True),
      ),
  )


def smem_bytes(k: int, n: int, config: Tcgen05Config | None = None,
               dtype=jnp.bfloat16) -> int:
  """Shared memory one CTA uses at dense K and N columns (the ring, the epilogue buffer,
  the barriers): what the launch reserves, which ptxas does not see (dynamic smem)."""
  cfg = config or Tcgen05Config()
  tn, tk = _tile_n(n, cfg), cfg.tile_k
  stages = min(cfg.stages, -(-k // tk))
  isz = jnp.dtype(dtype).itemsize
  ring = _TILE_M * (tk // 2) * isz + tn * tk * isz + (tk // _META_K) * _TILE_M * 64 // 4
  return stages * ring + _TILE_M * cfg.epilogue_n * isz + 8 * (2 * stages + 1)


def kernel_key(m: int, n: int, k: int, config: Tcgen05Config | None = None,
               dtype=jnp.bfloat16, out_dtype=None) -> tuple:
  """What determines the compiled kernel of sparse_matmul at (M, N, K): padded sizes,
  tiles, dtypes (kernels.compile_check: Mosaic GPU compiles each distinct kernel once)."""
  cfg = config or Tcgen05Config()
  cfg = dataclasses.replace(cfg, tile_n=_tile_n(n, cfg))
  up = lambda v, b: -(-v // b) * b   # noqa: E731
  return ("tcgen05", up(m, _TILE_M), up(n, cfg.tile_n), up(k, cfg.tile_k), cfg,
          jnp.dtype(dtype).name, jnp.dtype(out_dtype or dtype).name)


def _pad_to(x, axis, multiple, value=0):
  size = x.shape[axis]
  return c.pad_axis(x, axis, -(-size // multiple) * multiple, value)


def _tile_n(n: int, cfg: Tcgen05Config) -> int:
  """A smaller N tile for few columns (decode-like token counts)."""
  return 64 if n <= 64 else cfg.tile_n


def prepare_operands(a_values, a_meta, b, config: Tcgen05Config):
  """Pads to whole tiles and converts the metadata (plain jnp; runs anywhere).

  Returns (values [Mp, Kp/2], b [Np, Kp], tcgen05 metadata (Mp/128, Kp/128, 128, 64) uint2,
  the config with its N tile). Padding: zero values with empty groups (positions 0, 1) in A,
  zero rows / columns in B, so the padded product restricted to [:M, :N] is unchanged.
  """
  k, n = 2 * a_values.shape[1], b.shape[0]
  cfg = dataclasses.replace(config, tile_n=_tile_n(n, config))
  kp = -(-k // cfg.tile_k) * cfg.tile_k
  values = _pad_to(c.pad_axis(a_values, 1, kp // 2), 0, _TILE_M)
  meta = _pad_to(c.pad_axis(a_meta.astype(jnp.uint32), 1, c.meta_words(kp), c.EMPTY_WORD),
                 0, _TILE_M, c.EMPTY_WORD)
  # Unused nibbles of the last word of a row (K % 32 != 0) are EMPTY by the format.
  b = _pad_to(c.pad_axis(b, 1, kp), 0, cfg.tile_n)
  return values, b, tcgen05_metadata(meta, kp, a_values.dtype), cfg


@functools.partial(jax.jit, static_argnames=("out_dtype", "config"))
def _sparse_matmul(a_values, a_meta, b, *, out_dtype, config):
  m, n = a_values.shape[0], b.shape[0]
  values, b, fmt, cfg = prepare_operands(a_values, a_meta, b, config)
  out = _build(values.shape[0], b.shape[0], b.shape[1], a_values.dtype, out_dtype, cfg)(
      values, b, fmt)
  return out[:m, :n]


def _check(a_values, a_meta, b):
  if a_values.ndim != 2 or a_meta.ndim != 2 or b.ndim != 2:
    raise ValueError("tcgen05.sparse_matmul takes 2-D a_values [M, K/2], a_meta "
                     f"[M, ceil(K/32)], b [N, K]; got {a_values.shape}, {a_meta.shape}, "
                     f"{b.shape}.")
  k = 2 * a_values.shape[1]
  c.check_groups("the sparse operand", k)
  if b.shape[1] != k:
    raise ValueError(f"b [N, K] must have K = 2 * a_values.shape[1] = {k}; got {b.shape}.")
  if a_meta.shape != (a_values.shape[0], c.meta_words(k)):
    raise ValueError(f"a_meta shape {a_meta.shape} != (M, ceil(K/32)) = "
                     f"{(a_values.shape[0], c.meta_words(k))}.")
  if a_values.dtype != b.dtype or a_values.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError("tcgen05 sparse MMA operands must both be bf16 or both f16; got "
                     f"{a_values.dtype} and {b.dtype}.")


def sparse_matmul(a_values: jax.Array, a_meta: jax.Array, b: jax.Array, *,
                  out_dtype=None, config: Tcgen05Config | None = None) -> jax.Array:
  """C [M, N] = decompress24(a_values, a_meta) @ b^T on Blackwell's sparse tensor cores.

  a_values [M, K/2], a_meta [M, ceil(K/32)] uint32: the 2:4 operand, compressed along K
  (this package's format). b [N, K], same dtype (bf16 or f16). f32 accumulation; the result
  in `out_dtype` (default: the operands' dtype). Raises NotBlackwellError off a Blackwell GPU.
  """
  _check(a_values, a_meta, b)
  check_device()
  return _sparse_matmul(a_values, a_meta, b, out_dtype=jnp.dtype(out_dtype or b.dtype),
                        config=config or Tcgen05Config())


# ---------------------------------------------------------------------------------------------
# The three GEMMs of a 2:4 linear layer y = x W~^T


def forward(x: jax.Array, w_values: jax.Array, w_meta: jax.Array, *,
            config: Tcgen05Config | None = None) -> jax.Array:
  """y (T, out) = x W~^T, computed as y^T = W~ x^T.

  x (T, in); (w_values (out, in/2), w_meta (out, ceil(in/32))) = compress24(W~).
  """
  return sparse_matmul(w_values, w_meta, x, config=config).T


def data_grad(dy: jax.Array, wt_values: jax.Array, wt_meta: jax.Array, *,
              config: Tcgen05Config | None = None) -> jax.Array:
  """dX (T, in) = dY W~, computed as dX^T = W~^T dY^T.

  dy (T, out); (wt_values (in, out/2), wt_meta (in, ceil(out/32))): W~^T compressed along
  `out`, the third output of transposable_mask24(w, with_compressed=True) (W~'s mask must be
  transposable, 2:4 along both axes).
  """
  return sparse_matmul(wt_values, wt_meta, dy, config=config).T


def weight_grad(dy: jax.Array, x: jax.Array, seed, *,
                config: Tcgen05Config | None = None, interpret: bool = False) -> jax.Array:
  """dW~ (out, in) = MVUE(dY^T) x, the MVUE estimate compressed along the tokens.

  dy (T, out), x (T, in), T a multiple of 4; seed: uint32 (kernels.seed_from_key(key)).
  Unbiased: E[dW~] = dY^T x. `interpret` applies to the MVUE compress kernel only.
  """
  check_device()
  values, meta = mvue24_compress(dy.T, seed, interpret=interpret)   # (out, T/2), (out, T/32)
  return sparse_matmul(values, meta, x.T, config=config)


def reference(a_values, a_meta, b, out_dtype=None) -> jax.Array:
  """Plain XLA: decompress, dense matmul with f32 accumulation."""
  a = c.decompress(a_values, a_meta)
  y = jnp.dot(a, b.T, preferred_element_type=jnp.float32)
  return y.astype(out_dtype or b.dtype)


# ---------------------------------------------------------------------------------------------
# Benchmark rows (python -m s24jax.kernels.bench --only tcgen05; kernels/bench_harness.py)


def _bench_tcgen05(shapes, dtype, interpret, reps):
  """The forward 2:4 GEMM on Blackwell's sparse tensor cores vs the dense XLA GEMM of the
  same shape (TFLOP/s dense-equivalent)."""
  try:
    check_device()
  except NotBlackwellError:
    yield dict(kernel="tcgen05", shape="-", note="skipped: not a Blackwell GPU")
    return
  del interpret
  for t, n, k in shapes:
    x, values, meta, dense = bench_operands(t, n, k, dtype)
    fwd = jax.jit(forward)
    yield bench_harness.row("tcgen05_forward", (t, n, k),
                     bench_harness.time_fn(fwd, x, values, meta, reps=reps),
                     bench_harness.time_fn(jax.jit(bench_harness.dense_mm), x, dense, reps=reps),
                     flops=2 * t * n * k, note="xla: dense x @ W~^T")


BENCHMARKS = {"tcgen05": _bench_tcgen05}


__all__ = ["NotBlackwellError", "Tcgen05Config", "check_device", "data_grad", "forward",
           "kernel_key", "metadata_pairs", "prepare_operands", "reference", "smem_bytes",
           "sparse_matmul", "tcgen05_metadata", "weight_grad"]


if __name__ == "__main__":   # this family's rows of python -m s24jax.kernels.bench
  raise SystemExit(bench_harness.main(
      BENCHMARKS, prog="python -m s24jax.kernels.tcgen05",
      description="Benchmark the tcgen05 2:4 GEMM (Blackwell only) against XLA."))
