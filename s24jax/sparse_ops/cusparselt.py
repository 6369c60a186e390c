"""The 'cusparselt' backend: cuSPARSELt's 2:4 GEMMs through the XLA FFI (A100, H100 and newer).

With x (T, K) tokens, W~ (N, K) 2:4 along K, dY (T, N), every GEMM in a layout and with types
the library plans (kernels/cusparselt/rules.py; each GEMM is checked against those rules at
trace time):

  forward        y^T (N, T) = W~ x^T             A = W~, compressed once per step (`prepare`)
  data gradient  dX^T (K, T) = W~^T dY^T          transposable masks only (W~^T is 2:4 along N);
                                                  A = W~^T, compressed once per step; dense
                                                  XLA otherwise
  weight grad.   dW (N, K) = MVUE(dY^T) x          with sparsity.mvue (A = the estimate, 2:4
                                                  along T, compressed per micro-batch); dense
                                                  XLA otherwise

Compression. Each A operand is compressed by s24jax where its layout serves (kernels/
cusparselt/compression.py: jnp that XLA fuses with the projection, the transpose or the MVUE
draw that makes the operand, checked against the library once per shape on a GPU), else by
the library (`cusparseLtSpMMACompress`).

Layouts. 16-bit operands take every layout: where the library compresses, none is copied (dX
is the NN GEMM on W~ itself); where s24jax does, its layouts being TN only, dX is TN on W~^T,
written transposed from W~ in the compressing pass (no copy either). dW is the TT GEMM on x
itself. 8-bit (FP8) operands take only TN (R3), so x^T is materialized for dW (per
micro-batch). D is written in the order the next op reads it (y and dX as the column-major
D^T, dW row-major): no transposes.

Types. bf16 operands write bf16 (R2: there is no bf16-in, f32-out kernel), so each
micro-batch's dW is rounded to bf16 before the accumulation adds it in float32, where the 'xla'
backend keeps it in float32 (docs/backends.md gives the measured difference). FP8 (sparsity.fp8)
takes one FP8 type per GEMM (R1): the forward is e4m3 x e4m3, the backward GEMMs take dY and
W~ / x both in sparsity.fp8_backward_operands, which must be 'e5m2' here ('auto' picks it:
the S-STE reference's e5m2 backward, the same formats as the 'xla' backend's 'e5m2'); FP8
GEMMs write float32, with the per-tensor scales of 'xla' applied after. float32 operands are
refused (R7: 50% sparsity is 1:2 for float32). FP8 needs compute capability 8.9 (L4, L40S,
H100 and newer), 16-bit 8.0 (R8).

Which GEMMs run on cuSPARSELt (`sparsity.gemm_choice`, gemm_choice.py): by default only those
measured faster than the dense XLA GEMM of the same product, counting their compressions (W~
once per step, shared by the micro-batches; the MVUE estimate in each call); the others run
the dense GEMM of the same operands (common.py, as the 'xla' backend: the same masked W~, the
same MVUE estimate), and a compression that no chosen GEMM uses is not made. A layer none of
whose GEMMs runs on cuSPARSELt is the 'xla' backend itself (`linear`).

Under a mesh each device runs its own shard (`per_device`). Compiled for A100 and H100
without a GPU; its CPU tests use the jnp stand-in of kernels/cusparselt/ops.py, which
enforces the same rules and compresses in s24jax's layout. The library's GEMMs ran on an H100
and an H200 (2026-11-27, docs/gpu_report.md); s24jax's compression and the TN data gradient
have not run on a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from s24jax.sparse_ops import fp8 as fp8_lib
from s24jax.kernels import _common
from s24jax.kernels import masks
from s24jax.kernels.cusparselt import algorithms
from s24jax.kernels.cusparselt import compression
from s24jax.kernels.cusparselt import library
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.sparse_ops import backend as backend_lib
from s24jax.sparse_ops import common
from s24jax.sparse_ops import cusparselt_gemms as gemms
from s24jax.sparse_ops import gemm_choice
from s24jax.sparse_ops import gemm_times
from s24jax.sparse_ops import xla
from s24jax.sparse_ops.options import GemmOptions

# ---------------------------------------------------------------------------------------------
# Which GEMMs run on cuSPARSELt (sparsity.gemm_choice, gemm_choice.py).

_WHAT = {"forward": "y = x W~^T", "dgrad": "dX = dY W~", "wgrad": "dW~ = MVUE(dY^T) x"}


def _gemm(kind: str, t: int, n: int, k: int, a_dtype) -> cusparselt.Gemm:
  """The library's GEMM `kind` of a layer W~ (n, k) at t tokens, as the op runs it."""
  if kind == "forward":
    return gemms.fwd_gemm(t, n, k)
  if kind == "dgrad":
    return gemms.dgrad_gemm(t, n, k, gemms.dgrad_tn(t, n, k, a_dtype))
  return gemms.wgrad_gemm(t, n, k, gemms.k_major_only(a_dtype))


@functools.cache
def _library_version() -> str:
  """The cuSPARSELt serving the handlers (the loaded library's own version: in one process the
  first libcusparseLt loaded serves everything, torch's included), else the one they are
  built against (its header's), else 'unknown'."""
  try:
    return library.serving()["version"]
  except Exception:  # pylint: disable=broad-except  (a key field, not a reason to stop)
    try:
      return library.toolchain().cusparselt_version
    except library.Unavailable:
      return "unknown"


def gemm_key(kind: str, t: int, n: int, k: int, dtype, opts: GemmOptions) -> gemm_times.Key:
  """The measurement key of the GEMM `kind` of a layer W~ (n, k) at t tokens per device."""
  _, a_dtype, d_dtype = gemms.operand_types(kind, opts, dtype)
  g = _gemm(kind, t, n, k, a_dtype)
  return gemm_times.Key(
      **gemm_times.device_fields(_common.target_device()), library="cusparselt",
      library_version=_library_version(), **gemm_times.versions(), gemm=kind, m=g.m, n=g.n,
      k=g.k, layout=("T" if g.trans_a else "N") + ("T" if g.trans_b else "N"),
      d_order="row" if g.d_row_major else "col", a_type=cusparselt.dtype_name(a_dtype),
      b_type=cusparselt.dtype_name(a_dtype), d_type=cusparselt.dtype_name(d_dtype))


def choose(kind: str, t: int, n: int, k: int, dtype, opts: GemmOptions,
           compress_share: float) -> gemm_choice.Choice:
  """Whether the GEMM `kind` of a layer W~ (n, k) at t tokens per device in the compute
  `dtype` runs on cuSPARSELt; `compress_share`: the compressions of its sparse operand per
  call (gemm_choice.py). dX is dense without a transposable mask, dW without MVUE."""
  label = (f"{_WHAT[kind]}, W~ {n}x{k}, {t} tokens, "
           f"{'FP8' if opts.fp8 else jnp.dtype(dtype).name}")
  if kind == "dgrad" and not opts.transposable:
    return gemm_choice.no_choice(kind, label, "not transposable: W~ is 2:4 along `in` only")
  if kind == "wgrad" and not opts.mvue:
    return gemm_choice.no_choice(kind, label, "no MVUE: dY^T is dense")
  measure = None
  # Never under the stand-in: it would time jnp, not the library (CPU tests on a GPU host).
  standin = cusparselt._STANDIN   # pylint: disable=protected-access
  if gemm_times.can_measure(_common.target_device()) and not standin:
    measure = functools.partial(measure_times, kind, t, n, k, dtype, opts)
  return gemm_choice.choose(opts.gemm_choice, opts.gemm_table,
                            gemm_key(kind, t, n, k, dtype, opts),
                            compress_share=compress_share, label=label, measure=measure)


def algorithm(kind: str, t: int, n: int, k: int, dtype,
              opts: GemmOptions) -> algorithms.Algorithm | None:
  """The library's algorithm found for the GEMM `kind` (searched at first use and cached with
  its times, `measure_times`), or None: the library's default selection."""
  times = choose(kind, t, n, k, dtype, opts, 1.0).times
  found = times.algorithm if times is not None else None
  return algorithms.Algorithm(*found) if found is not None else None


def choices(opts: GemmOptions, w_shape, tokens: int, dtype,
            micro_batches: int) -> list[gemm_choice.Choice]:
  """The choice of each GEMM of a layer W~ `w_shape` (Backend.choices): W~'s compressions
  for the forward and dX shared by `micro_batches` (1: compressed in each call)."""
  n, k = w_shape
  share = 1.0 / micro_batches
  return [choose("forward", tokens, n, k, dtype, opts, share),
          choose("dgrad", tokens, n, k, dtype, opts, share),
          choose("wgrad", tokens, n, k, dtype, opts, 1.0)]


def measure_times(kind: str, t: int, n: int, k: int, dtype,
                  opts: GemmOptions) -> gemm_times.Times:
  """Times the GEMM `kind` on this process's GPU, on random operands, outside the step being
  traced: the library's fastest algorithm for it (cusparseLtMatmulSearch), kept only if it
  agrees with the default on the same operands (pytorch/pytorch#155333: some algorithm ids
  gave wrong results; one warning, and the default, if not); then cuSPARSELt under that
  algorithm on its compressed operand, the compression as the step runs it (FP8: with the
  quantization), and the dense XLA GEMM the backend runs instead, each the median of
  gemm_times.REPS timed loops with their spread (gemm_times.per_call_stats)."""
  opts = dataclasses.replace(opts, token_axes=())   # one device, outside shard_map
  fmt, a_dtype, d_dtype = gemms.operand_types(kind, opts, dtype)
  gemm = _gemm(kind, t, n, k, a_dtype)

  def run() -> gemm_times.Times:
    ka, kb = jax.random.split(jax.random.key(0))
    op_a = jax.random.normal(ka, (gemm.m, gemm.k), jnp.float32)
    op_a = jnp.where(masks.nm_mask(op_a), op_a, 0).astype(dtype)   # (m, k), 2:4 along k
    a = op_a if gemm.trans_a else op_a.T                           # gemm.a_shape()
    b = jax.random.normal(kb, gemm.b_shape(), jnp.float32).astype(dtype)
    dense = {"forward": lambda: (lambda x, w: common.fwd_gemm(x, w, opts), b, op_a),
             "dgrad": lambda: (lambda dy, w: common.dgrad_gemm(dy, w, opts), b, op_a.T),
             "wgrad": lambda: (lambda est, x: common.wgrad_product(est, x, opts), op_a,
                               b if gemm.trans_b else b.T)}[kind]()

    # The compression as the step runs it: dX's TN operand W~^T is written from W~ itself.
    transposed = kind == "dgrad" and gemm.trans_a
    source = a.T if transposed else a

    def compress(src):
      qa, _ = gemms.quantize(src.T if transposed else src, fmt, opts)
      return compression.compress(qa, gemm, b_dtype=a_dtype, d_dtype=d_dtype)

    _, a_scale = gemms.quantize(a, fmt, opts)
    compressed = jax.jit(compress)(source)
    qb, _ = gemms.quantize(b, fmt, opts)
    alg, _ = algorithms.search(compressed, qb, gemm, a_dtype=a_dtype, out_dtype=d_dtype)
    wrong = algorithms.check_against_default(compressed, qb, gemm, alg, a_dtype=a_dtype,
                                             out_dtype=d_dtype)
    if wrong is not None:
      logging.warning("cuSPARSELt's algorithm %s for %s disagrees with its default on the "
                      "same operands (%s): the default runs instead.", alg, gemm, wrong)
      alg = algorithms.DEFAULT

    def spmm(compressed, b):
      return gemms.compressed_gemm(compressed, a_dtype, a_scale, b, gemm, opts, fmt, alg)

    sparse_ms, sparse_spread = gemm_times.per_call_stats(spmm, compressed, b)
    compress_ms, compress_spread = gemm_times.per_call_stats(compress, source)
    dense_ms, dense_spread = gemm_times.per_call_stats(*dense)
    dev = jax.devices()[0]
    return gemm_times.Times(
        sparse_ms=sparse_ms, compress_ms=compress_ms, dense_ms=dense_ms,
        source=f"measured on {dev.device_kind} at first use, {time.strftime('%Y-%m-%d')}",
        sparse_spread_ms=sparse_spread, compress_spread_ms=compress_spread,
        dense_spread_ms=dense_spread,
        algorithm=(alg.alg_id, alg.split_k, alg.split_k_mode, alg.split_k_buffers))

  return gemm_times.outside_trace(run)


def prepare(w: jax.Array, *, tokens: int, dtype, opts: GemmOptions,
            micro_batches: int = 1) -> dict[str, jax.Array]:
  """W~ (N, K) compressed for the forward ('fwd') and, for transposable masks, the
  data-gradient GEMM ('dx') of a micro-batch of `tokens` tokens per device, in `dtype` (FP8:
  the forward's e4m3 and the backward's format, with their scales 'fwd_scale', 'dx_scale'),
  each only where sparsity.gemm_choice runs that GEMM on cuSPARSELt (its compression shared
  by the step's `micro_batches`). The train step computes these once per optimizer step,
  outside the accumulation loop, so that no micro-batch and no recomputed forward compresses
  W~ again."""
  n, k = w.shape
  fwd_fmt, bwd_fmt = gemms.formats(opts)
  cusparselt.check_device(dtype if fwd_fmt is None else fwd_fmt)
  share = 1.0 / micro_batches
  w = jax.lax.stop_gradient(w).astype(dtype)
  prepared = {}
  if choose("forward", tokens, n, k, dtype, opts, share).sparse:
    # W~ is replicated (the FSDP all-gather): its own amax is the global one.
    qw, sw = (w, None) if fwd_fmt is None else fp8_lib.quantize(w, fwd_fmt)
    prepared["fwd"] = compression.compress(qw, gemms.fwd_gemm(tokens, n, k),
                                           b_dtype=qw.dtype,
                                           d_dtype=gemms.out_dtype(fwd_fmt, dtype))
    if sw is not None:
      prepared["fwd_scale"] = sw
  if choose("dgrad", tokens, n, k, dtype, opts, share).sparse:   # transposable masks only
    qd, sd = (w, None) if bwd_fmt is None else fp8_lib.quantize(w, bwd_fmt)
    tn = gemms.dgrad_tn(tokens, n, k, qd.dtype)
    prepared["dx"] = compression.compress(qd.T if tn else qd,
                                          gemms.dgrad_gemm(tokens, n, k, tn), b_dtype=qd.dtype,
                                          d_dtype=gemms.out_dtype(bwd_fmt, dtype))
    if sd is not None:
      prepared["dx_scale"] = sd
  return prepared


def _a_dtype(fmt, x: jax.Array):
  """The dtype an A operand was compressed in: the GEMM's FP8 format, else x's dtype."""
  return x.dtype if fmt is None else fmt


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def linear_2d(opts: GemmOptions, x: jax.Array, w: jax.Array, key: jax.Array | None,
              prepared: dict) -> jax.Array:
  t, k = x.shape
  n = w.shape[0]
  fmt, _ = gemms.formats(opts)
  if "fwd" in prepared:
    y = gemms.compressed_gemm(prepared["fwd"], _a_dtype(fmt, x), prepared.get("fwd_scale"),
                              x, gemms.fwd_gemm(t, n, k), opts, fmt,
                              algorithm("forward", t, n, k, x.dtype, opts))   # (T, N)
  elif choose("forward", t, n, k, x.dtype, opts, 1.0).sparse:
    y = gemms.sparse_gemm(w.astype(x.dtype), x, gemms.fwd_gemm(t, n, k), opts, fmt,
                          algorithm("forward", t, n, k, x.dtype, opts))    # (T, N)
  else:
    y = common.fwd_gemm(x, w.astype(x.dtype), opts)                      # (T, N), dense
  return y.astype(x.dtype)


def _fwd(opts, x, w, key, prepared):
  # W~ itself is needed in the backward only where a GEMM compresses it there or is dense.
  # (Otherwise a zero-size stand-in of W~'s row count and dtype.)
  keep_w = not (opts.transposable and "dx" in prepared)
  w_res = w if keep_w else jnp.zeros((w.shape[0], 0), w.dtype)
  return linear_2d(opts, x, w, key, prepared), (x, w_res, key, prepared)


def _bwd(opts, res, dy):
  x, w, key, prepared = res
  (t, k), n = x.shape, w.shape[0]
  _, fmt = gemms.formats(opts)
  dy = dy.astype(x.dtype)
  tn_dx = gemms.dgrad_tn(t, n, k, _a_dtype(fmt, x))
  tn = gemms.k_major_only(_a_dtype(fmt, x))
  if "dx" in prepared:   # (transposable masks only)
    dx = gemms.compressed_gemm(prepared["dx"], _a_dtype(fmt, x), prepared.get("dx_scale"),
                               dy, gemms.dgrad_gemm(t, n, k, tn_dx), opts, fmt,
                               algorithm("dgrad", t, n, k, x.dtype, opts))   # (T, K)
  elif choose("dgrad", t, n, k, x.dtype, opts, 1.0).sparse:
    wd = w.astype(x.dtype)
    dx = gemms.sparse_gemm(wd.T if tn_dx else wd, dy, gemms.dgrad_gemm(t, n, k, tn_dx),
                           opts, fmt, algorithm("dgrad", t, n, k, x.dtype, opts))  # (T, K)
  else:
    dx = common.dgrad_gemm(dy, w.astype(dy.dtype), opts)                   # (T, K), dense
  if opts.mvue:   # the point of MVUE: dW = MVUE(dY^T) x, 2:4 along the tokens
    est = common.wgrad_operand(dy, key, opts)                              # (N, T)
    if choose("wgrad", t, n, k, x.dtype, opts, 1.0).sparse:
      dw = gemms.sparse_gemm(est, x.T if tn else x, gemms.wgrad_gemm(t, n, k, tn), opts,
                             fmt, algorithm("wgrad", t, n, k, x.dtype, opts))   # (N, K)
    else:
      dw = common.wgrad_product(est, x, opts)                              # (N, K), dense
  else:
    dw = common.wgrad_gemm(dy, x, key, opts)                               # (N, K), dense
  dprepared = jax.tree.map(
      lambda p: (jnp.zeros_like(p) if jnp.issubdtype(p.dtype, jnp.floating)
                 else np.zeros(p.shape, jax.dtypes.float0)), prepared)
  return dx.astype(x.dtype), dw.astype(w.dtype), common.key_cotangent(key), dprepared


linear_2d.defvjp(_fwd, _bwd)


def per_device(op, opts: GemmOptions):
  """`op` on each device's own rows of x under the context mesh (jax.sharding.get_abstract_mesh,
  set by the train step): an opaque custom call cannot be partitioned by XLA, which would
  otherwise gather the batch-sharded activations and run the whole global GEMM everywhere.
  W~ is replicated into it (the FSDP all-gather, as for any GEMM); its gradient is summed
  over the devices by shard_map's transpose (the data-parallel all-reduce). MVUE draws from
  fold_in(key, device index), so the shards' estimates are independent; FP8 scales are the
  whole tensors' (a pmax of the shards' amax)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return functools.partial(op, opts)
  axes = tuple(mesh.axis_names)
  P = jax.sharding.PartitionSpec
  local_opts = dataclasses.replace(opts, token_axes=axes)

  def local(x, w, key, prepared):
    if key is not None and opts.mvue:
      key = jax.random.fold_in(key, jax.lax.axis_index(axes))
    return op(local_opts, x, w, key, prepared)

  def sharded(x, w, key, prepared):
    key_spec = None if key is None else P()
    prepared_spec = jax.tree.map(lambda _: P(), prepared)   # per device, as compressed
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(P(axes, None), P(), key_spec, prepared_spec),
                         out_specs=P(axes, None), check_vma=False)(x, w, key, prepared)

  return sharded


def _devices() -> int:
  """The devices `per_device` splits the tokens over."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else mesh.size


def linear(opts, x, w, key, prepared):
  """The op; a layer none of whose GEMMs runs on cuSPARSELt is the 'xla' reference itself."""
  t, (n, k) = x.shape[0] // _devices(), w.shape
  fwd_fmt, _ = gemms.formats(opts)
  cusparselt.check_device(x.dtype if fwd_fmt is None else fwd_fmt)
  if not prepared and not any(c.sparse for c in choices(opts, (n, k), t, x.dtype, 1)):
    return xla.linear_2d(opts, x, w, key)
  return per_device(linear_2d, opts)(x, w, key, dict(prepared))


BACKEND = backend_lib.Backend(linear=linear, prepare=prepare, check=gemms.check,
                              fp8_backward=gemms.FP8_BACKWARD, choices=choices)
