"""The GEMMs section: each cuSPARSELt GEMM of the sparse linear op, its two compressions, the
dense XLA GEMM of the same product and PyTorch's cuSPARSELt; one row per GEMM (gemm_plan.py:
which rows, in which order, at what cost).

A row (gemm_plan.Row: kind, layer W~ (N, K), tokens, precision) is the GEMM as the op runs it
(`op_gemm`: its cuSPARSELt `Gemm`, layout and types) on random operands, op(A) 2:4 along k and,
under FP8, quantized beforehand (A's quantization is not timed; B's is, inside the GEMM, as in
the op). Milliseconds per call of each variant (VARIANTS), all timed by ONE compiled program
(gemm_program.py; `calls` per loop, the median of REPEATS loops, `spread_ms` their range):

  sparse                   cuSPARSELt on A compressed beforehand (the step's W~), under the
                           library's default algorithm
  sparse_searched          the same under the algorithm the library's search found
  compress_s24jax          s24jax's compression alone (layout.py's layout for the GPU; only
                           where the GEMM is TN and a layout covers the shape); dX's W~^T is
                           written from W~, as in the step
  compress_library         the library's compression alone (cusparseLtSpMMACompress2)
  compress_<which>+sparse  that compression and the GEMM in every call (the step compresses
                           the MVUE estimate of dW in every call, W~ once per step)
  dense_xla                the dense XLA GEMM the backend runs instead (common.py; FP8: both
                           operands quantized in every call, as the 'xla' backend does)
  torch_sparse, torch_sparse+compress   torch._cslt_sparse_mm (+ torch._cslt_compress) on the
                           same GEMM when torch with CUDA is importable (torch_peer.py: CUDA
                           events around n calls)

Also per row: the library's algorithm search (`algorithm`: its fields and `max_id`), that
algorithm checked against the default (`alg_check`: None or the disagreement; only where D has
at most CHECK_MAX_OUTPUTS outputs, since check_against_default compares them on the host in
float64), the compression the op uses (`op_compression`), s24jax's compression's bandwidth
(`compression_bandwidth`, bandwidth.py), the 2:4 kernel against dense (`vs_dense`: where the
faster of its two algorithms is at least FASTER x dense, whether each compression + GEMM still
is), and the process's libcusparseLt (`libraries`, libraries.py).

The op's dX is TN where s24jax has a layout for W~^T (and always for 8-bit types): `op_gemm`
decides it from the layout alone, as the op does where its check of the layout against the
library passes (the layouts section says whether it does), because that check builds a probe
of the operand's full size on the host (seconds for the large layers) at first use.

Never run on a GPU in this form: on a CPU (--smoke) it runs on the cuSPARSELt stand-in, whose
figures say nothing about a GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from s24jax import sparse_ops
from s24jax.perf.gpu_report import bandwidth
from s24jax.perf.gpu_report import gemm_plan
from s24jax.perf.gpu_report import gemm_program
from s24jax.perf.gpu_report import layouts
from s24jax.perf.gpu_report import libraries
from s24jax.perf.gpu_report import rows as rows_lib
from s24jax.perf.gpu_report import torch_peer
from s24jax.kernels import masks
from s24jax.kernels.cusparselt import algorithms
from s24jax.kernels.cusparselt import layout
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.sparse_ops import common
from s24jax.sparse_ops import cusparselt_gemms as cslt

VARIANTS = gemm_plan.VARIANTS
TORCH_VARIANTS = ("torch_sparse", "torch_sparse+compress")
COMPRESSIONS = ("s24jax", "library")
CHECK_MAX_OUTPUTS = 2 ** 26   # ~48 bytes an output on the host (float64 copies): ~3 GiB
FASTER = 1.10                 # "at least 10 % faster than dense": dense ms / kernel ms


def _opts(fp8: bool) -> sparse_ops.GemmOptions:
  opts = sparse_ops.GemmOptions(mvue=True, fp8=fp8, transposable=True, backend="cusparselt",
                                fp8_backward_operands="e5m2" if fp8 else "e4m3")
  if "gemm_choice" in {f.name for f in dataclasses.fields(opts)}:
    opts = dataclasses.replace(opts, gemm_choice="sparse")   # every GEMM on cuSPARSELt
  return opts


def op_gemm(kind: str, t: int, n: int, k: int, a_dtype, cc) -> cusparselt.Gemm:
  """The library's GEMM `kind` of a layer W~ (n, k) at t tokens as the op runs it on a GPU of
  compute capability `cc` (module docstring: dX's layout from the layout alone)."""
  if kind == "forward":
    return cslt.fwd_gemm(t, n, k)
  if kind == "dgrad":
    tn = cslt.k_major_only(a_dtype) or layout.for_target(
        cc, jnp.dtype(a_dtype).itemsize, k, n) is not None
    return cslt.dgrad_gemm(t, n, k, tn)
  return cslt.wgrad_gemm(t, n, k, cslt.k_major_only(a_dtype))


@dataclasses.dataclass(frozen=True)
class Setup:
  """A row's GEMM as the op runs it: its options, FP8 format (or None), types, the layout
  s24jax writes its A in (None: the library compresses), and whether that A (dX's W~^T) is
  written from its transpose."""
  row: gemm_plan.Row
  opts: sparse_ops.GemmOptions
  fmt: object
  a_dtype: object
  d_dtype: object
  gemm: cusparselt.Gemm
  lay: layout.Layout | None
  transposed: bool


def setup(row: gemm_plan.Row, smoke: bool) -> Setup:
  opts = _opts(row.precision == "fp8")
  n, k = row.shape_nk
  fmt, a_dtype, d_dtype = cslt.operand_types(row.kind, opts, jnp.bfloat16)
  cc = layouts.compute_capability(smoke)
  gemm = op_gemm(row.kind, row.tokens, n, k, a_dtype, cc)
  lay = (layout.for_target(cc, jnp.dtype(a_dtype).itemsize, gemm.m, gemm.k)
         if gemm.trans_a else None)
  return Setup(row, opts, fmt, a_dtype, d_dtype, gemm, lay,
               transposed=row.kind == "dgrad" and gemm.trans_a)


def operands(s: Setup) -> tuple[dict[str, jax.Array], jax.Array | None]:
  """({name: array}, A's FP8 scale or None): 'a' the A array (quantized under FP8), 'source'
  what s24jax compresses it from, 'b' the B array (bf16: quantized in the GEMM), 'compressed'
  A compressed by the library, 'dense_0', 'dense_1' the dense GEMM's operands."""
  g = s.gemm

  def make():
    ka, kb = jax.random.split(jax.random.key(0))
    op_a = jax.random.normal(ka, (g.m, g.k), jnp.float32)
    op_a = jnp.where(masks.nm_mask(op_a), op_a, 0).astype(jnp.bfloat16)   # (m, k), 2:4 along k
    a = op_a if g.trans_a else op_a.T                                    # g.a_shape()
    b = jax.random.normal(kb, g.b_shape(), jnp.float32).astype(jnp.bfloat16)
    qa, a_scale = cslt.quantize(a, s.fmt, s.opts)
    dense = {"forward": (b, op_a), "dgrad": (b, op_a.T),
             "wgrad": (op_a, b if g.trans_b else b.T)}[s.row.kind]
    return {"a": qa, "source": qa.T if s.transposed else qa, "b": b,
            "dense_0": dense[0], "dense_1": dense[1]}, a_scale

  ops, a_scale = jax.jit(make)()
  ops["compressed"] = jax.jit(lambda a: cusparselt.compress(
      a, g, b_dtype=s.a_dtype, d_dtype=s.d_dtype))(ops["a"])
  return ops, a_scale


def variants(s: Setup, a_scale, alg: algorithms.Algorithm | None, smoke: bool
             ) -> list[gemm_program.Variant]:
  """The row's timed variants (VARIANTS; those that do not apply left out), each with its
  calls per loop."""
  g, itemsize = s.gemm, jnp.dtype(s.a_dtype).itemsize

  def gemm(compressed, b, alg=None):
    # cslt.compressed_gemm, with the algorithm: B quantized here under FP8, scales after.
    qb, sb = cslt.quantize(b, s.fmt, s.opts)
    d = cusparselt.spmm(compressed, qb, g, a_dtype=s.a_dtype, out_dtype=s.d_dtype,
                        alg=alg).astype(jnp.float32)
    return d if s.fmt is None else d * ((1.0 / a_scale) * (1.0 / sb))

  def ours(source):
    return layout.compress(source.T if s.transposed else source, s.lay)

  def theirs(a):
    return cusparselt.compress(a, g, b_dtype=s.a_dtype, d_dtype=s.d_dtype)

  opts = s.opts
  dense = {"forward": lambda x, w: common.fwd_gemm(x, w, opts),
           "dgrad": lambda dy, w: common.dgrad_gemm(dy, w, opts),
           "wgrad": lambda est, x: common.wgrad_product(est, x, opts)}[s.row.kind]
  table = {   # name: (fn, operand names)
      "sparse": (gemm, ("compressed", "b")),
      "sparse_searched": (lambda c, b: gemm(c, b, alg), ("compressed", "b")),
      "compress_s24jax": (ours, ("source",)),
      "compress_library": (theirs, ("a",)),
      "compress_s24jax+sparse": (lambda src, b: gemm(ours(src), b), ("source", "b")),
      "compress_library+sparse": (lambda a, b: gemm(theirs(a), b), ("a", "b")),
      "dense_xla": (dense, ("dense_0", "dense_1"))}
  skip = ({"sparse_searched"} if alg is None else set()) | (
      {"compress_s24jax", "compress_s24jax+sparse"} if s.lay is None else set())
  guess = gemm_plan.variant_seconds(g.m, g.n, g.k, itemsize)
  return [gemm_program.Variant(name, fn, args, gemm_plan.calls_for(guess[name], smoke))
          for name, (fn, args) in table.items() if name not in skip]


def estimate_seconds(row: gemm_plan.Row, peer: bool, smoke: bool) -> float:
  """What a row is expected to cost (gemm_plan.row_seconds), from its shape alone."""
  m, n, k = gemm_plan.gemm_dims(row)
  per_call = gemm_plan.variant_seconds(m, n, k, 1 if row.precision == "fp8" else 2)
  check = gemm_plan.check_seconds(m, n, k) if m * n <= CHECK_MAX_OUTPUTS else 0.0
  return gemm_plan.row_seconds(per_call, per_call["sparse"], check, peer, smoke)


def versus_dense(ms: dict[str, float | None]) -> dict:
  """dense / 2:4 time of the kernel (the faster of its two algorithms) and, where that is at
  least FASTER, of each compression + GEMM."""
  dense = ms.get("dense_xla")
  kernels = [ms.get(v) for v in ("sparse", "sparse_searched") if ms.get(v)]
  if not dense or not kernels:
    return {"kernel_speedup": None, "kernel_faster": None}
  speedup = dense / min(kernels)
  out = {"kernel_speedup": speedup, "kernel_faster": speedup >= FASTER}
  if out["kernel_faster"]:
    with_c = {c: dense / ms[f"compress_{c}+sparse"] if ms.get(f"compress_{c}+sparse")
              else None for c in COMPRESSIONS}
    out["with_compression_speedup"] = with_c
    out["with_compression_faster"] = {c: None if v is None else v >= FASTER
                                      for c, v in with_c.items()}
  return out


def _search_and_check(s: Setup, ops: dict, out: dict, errors: dict):
  """The library's algorithm for the GEMM and its check against the default, into `out`
  (failures into `errors`); the algorithm, or None."""
  qb = jax.jit(lambda b: cslt.quantize(b, s.fmt, s.opts)[0])(ops["b"])
  kw = dict(a_dtype=s.a_dtype, out_dtype=s.d_dtype)
  out["algorithm"], out["alg_check"], out["alg_check_skipped"] = None, None, None
  try:
    alg, max_id = algorithms.search(ops["compressed"], qb, s.gemm, **kw)
  except Exception as e:  # pylint: disable=broad-except  (recorded; the row goes on)
    errors["search"] = rows_lib.error_line(e)
    out["alg_check_skipped"] = "no algorithm: the search failed"
    return None
  out["algorithm"] = {**alg.attrs(), "max_id": max_id}
  outputs = s.gemm.m * s.gemm.n
  if outputs > CHECK_MAX_OUTPUTS:
    out["alg_check_skipped"] = (f"D has {outputs} outputs, over {CHECK_MAX_OUTPUTS}: "
                                "check_against_default compares them on the host in float64")
    return alg
  try:
    out["alg_check"] = algorithms.check_against_default(ops["compressed"], qb, s.gemm, alg,
                                                        **kw)
  except Exception as e:  # pylint: disable=broad-except
    errors["alg_check"] = rows_lib.error_line(e)
  return alg


def measure(row: gemm_plan.Row, *, smoke: bool, peer: bool, repeats: int,
            device_kind: str) -> dict:
  """Every field of one row (module docstring)."""
  s = setup(row, smoke)
  g = s.gemm
  out = {"gemm": dict(m=g.m, n=g.n, k=g.k, layout=("T" if g.trans_a else "N")
                      + ("T" if g.trans_b else "N"), d_order="row" if g.d_row_major else "col"),
         "a_dtype": cusparselt.dtype_name(s.a_dtype),
         "d_dtype": cusparselt.dtype_name(s.d_dtype),
         "s24jax_layout": s.lay.name if s.lay else None,
         "op_compression": "s24jax" if s.lay else "library"}
  errors = {}
  ops, a_scale = operands(s)
  alg = _search_and_check(s, ops, out, errors)
  timed = variants(s, a_scale, alg, smoke)
  program = gemm_program.build(timed)
  seconds, failed = gemm_program.seconds_per_call(program, ops, timed, repeats)
  errors.update(failed)
  out["calls"] = {v.name: v.calls for v in timed}
  out["ms"] = {name: 1e3 * statistics.median(seconds[name]) if seconds.get(name) else None
               for name in VARIANTS}
  out["spread_ms"] = {name: 1e3 * (max(seconds[name]) - min(seconds[name]))
                      if seconds.get(name) else None for name in VARIANTS}
  if peer:
    calls = gemm_plan.calls_for(gemm_plan.gemm_seconds(g.m, g.n, g.k), smoke)
    try:
      out["ms"].update(torch_peer.times_ms(g, s.a_dtype, s.d_dtype, calls=calls,
                                           repeats=repeats))
    except Exception as e:  # pylint: disable=broad-except
      errors["torch"] = rows_lib.error_line(e)
  for name in TORCH_VARIANTS:
    out["ms"].setdefault(name, None)
  out["compression_bandwidth"] = bandwidth.compression(
      out["ms"]["compress_s24jax"], g.m, g.k, jnp.dtype(s.a_dtype).itemsize, device_kind)
  out["vs_dense"] = versus_dense(out["ms"])
  out["errors"] = errors
  return out


def run(section: rows_lib.Section, deadline: float, smoke: bool) -> None:
  """Every row of gemm_plan.plan, each recorded as it ends; rows that cannot finish before
  `deadline` are recorded as skipped. --smoke: the cuSPARSELt stand-in (a CPU)."""
  libraries.snapshot(register=True)          # s24jax's libcusparseLt first, then torch's
  peer_missing = torch_peer.unavailable()
  if peer_missing:
    section.skipped("torch peer", peer_missing)
  repeats = 1 if smoke else gemm_plan.REPEATS
  device_kind = jax.devices()[0].device_kind
  for row in gemm_plan.plan(smoke):
    fields = row.fields()
    left = deadline - time.time()
    need = estimate_seconds(row, not peer_missing, smoke)
    if need > left:
      section.skipped(row.name, f"budget: {left:.0f} s left, the row needs about {need:.0f} s",
                      **fields)
      continue

    def measure_row(row=row):
      out = measure(row, smoke=smoke, peer=not peer_missing, repeats=repeats,
                    device_kind=device_kind)
      out["libraries"] = libraries.snapshot(register=True)
      return out

    with cusparselt.standin() if smoke else contextlib.nullcontext():
      section.guarded(row.name, measure_row, estimated_seconds=round(need, 1), **fields)
