"""A step's time from its kernels (`step_census.Kernel`): a roofline per kernel, with three
global constants, and measured times for the kernels a roofline cannot know (cuSPARSELt).

Per launch of a kernel:

  t = max(FLOPs / F_k, bytes / B) + c

  F   achieved FLOP/s of the bf16 GEMMs and attention (F_k = FP8_SPEEDUP x F for a GEMM
      with FP8 operands: an H100's FP8 tensor cores have twice the bf16 peak); every other
      kernel's FLOPs count against F too (they never bind: a few FLOPs per byte)
  B   achieved memory bandwidth (bytes: operands and outputs, `step_census`)
  c   a per-kernel cost (launch and tail)

The cuSPARSELt FFI calls are opaque to XLA; their times come from a measured table
(`SparseTable`, the GEMM rows of a GPU run), scaled to the call's shape:

  spmm      (sparse_ms - d) x FLOPs / FLOPs_measured + c, where d = dense_ms - (the model's
            time of the dense GEMM of the measured product): the table's times are single
            jitted calls timed on the host, so each holds a dispatch cost d; the dense GEMM
            of the same row, timed the same way, gives d (at least 0). Per GEMM kind
            (forward, dgrad, wgrad) and precision (bf16, FP8) as measured.
  compress  compress_ms x bytes / bytes_measured + c (compress_ms is a difference of two
            host timings, so the dispatch cancels): W~ and W~^T (outside the backward) at the
            forward and data-gradient rows' mean rate, the MVUE estimate (in the backward) at
            the weight-gradient row's.

Both scalings (time proportional to FLOPs, to bytes) are a stated rule, not a measurement:
a shape other than the measured one is a prediction. `fit` finds F, B and c that minimize
the squared relative error over measured step times (`Row`).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

from s24jax import step_census

FP8_SPEEDUP = 2.0
GEMM_KINDS = ("forward", "dgrad", "wgrad")
# Bounds of the fit (a search range, not a claim): an H100 SXM's dense bf16 peak is 989
# TFLOP/s and its HBM3 3.35 TB/s.
BOUNDS = {"flops_per_s": (50e12, 989e12), "bytes_per_s": (0.2e12, 3.35e12),
          "launch_s": (0.0, 100e-6)}


@dataclasses.dataclass(frozen=True)
class Constants:
  flops_per_s: float     # F
  bytes_per_s: float     # B
  launch_s: float        # c

  def describe(self) -> str:
    return (f"F = {self.flops_per_s / 1e12:.0f} TFLOP/s, B = {self.bytes_per_s / 1e12:.2f} "
            f"TB/s, c = {self.launch_s * 1e6:.1f} us")


@dataclasses.dataclass(frozen=True)
class SparseGemm:
  """One measured cuSPARSELt GEMM (milliseconds per single host-timed call)."""
  kind: str              # forward, dgrad, wgrad
  precision: str         # bf16, fp8
  m: int                 # the library's M, N, K of the call
  n: int
  k: int
  sparse_ms: float       # kernel on an operand compressed beforehand
  compress_ms: float     # one compression of the sparse operand (A, m x k)
  dense_ms: float        # the dense XLA GEMM of the same product...
  dense_precision: str = "bf16"   # ... in bf16 or with FP8 operands

  @property
  def flops(self) -> float:
    return 2.0 * self.m * self.n * self.k

  @property
  def a_bytes(self) -> float:
    return self.m * self.k * (1 if self.precision == "fp8" else 2)


@dataclasses.dataclass(frozen=True)
class SparseTable:
  gemms: tuple[SparseGemm, ...]

  def get(self, kind: str, precision: str) -> SparseGemm:
    for g in self.gemms:
      if g.kind == kind and g.precision == precision:
        return g
    raise KeyError(f"no measured cuSPARSELt {kind} GEMM in {precision}")


def gemm_kind(kernel: step_census.Kernel) -> str:
  """forward, dgrad or wgrad of a cuSPARSELt spmm call: the weight gradient writes D
  row-major; a call in the backward pass (jax's `transpose(...)` name) that is not a
  rematerialized forward is the data gradient."""
  if kernel.attributes.get("d_row_major") == "true":
    return "wgrad"
  backward = "transpose(" in kernel.op_name and "rematted_computation" not in kernel.op_name
  return "dgrad" if backward else "forward"


def precision(kernel: step_census.Kernel) -> str:
  a = kernel.attributes.get("a_dtype") or kernel.attributes.get("b_dtype") or "bf16"
  return "fp8" if a.strip('"').startswith(("e4m3", "e5m2", "f8")) else "bf16"


def _dense_model_s(g: SparseGemm, c: Constants) -> float:
  """The model's time of the dense GEMM the table timed for a measured product."""
  fp8 = g.dense_precision == "fp8"
  rate = c.flops_per_s * (FP8_SPEEDUP if fp8 else 1.0)
  size = 1 if fp8 else 2
  nbytes = size * (g.m * g.k + g.k * g.n) + 2 * g.m * g.n
  return max(g.flops / rate, nbytes / c.bytes_per_s) + c.launch_s


def kernel_seconds(kernel: step_census.Kernel, c: Constants,
                   table: SparseTable | None = None) -> float:
  """One launch of `kernel` (the module docstring)."""
  if kernel.category == step_census.SPARSE_GEMM and kernel.target.startswith("cusparselt"):
    g = _table(table).get(gemm_kind(kernel), precision(kernel))
    dispatch = max(0.0, g.dense_ms * 1e-3 - _dense_model_s(g, c))
    kernel_s = max(g.sparse_ms * 1e-3 - dispatch, 0.0)
    return kernel_s * kernel.flops / g.flops + c.launch_s
  if kernel.category == step_census.COMPRESSION and kernel.target.startswith("cusparselt"):
    t = _table(table)
    prec = precision(kernel)
    if "transpose(" in kernel.op_name:            # the MVUE estimate, per micro-batch
      rows = [t.get("wgrad", prec)]
    else:                                         # W~ and W~^T, once per step
      rows = [t.get("forward", prec), t.get("dgrad", prec)]
    rate = sum(g.a_bytes / (g.compress_ms * 1e-3) for g in rows) / len(rows)   # bytes/s
    return kernel.operand_bytes / rate + c.launch_s
  rate = c.flops_per_s * (FP8_SPEEDUP if kernel.fp8_gemm else 1.0)
  return max(kernel.flops / rate, kernel.bytes / c.bytes_per_s) + c.launch_s


def _table(table: SparseTable | None) -> SparseTable:
  if table is None:
    raise ValueError("the step has cuSPARSELt calls: their times need a measured SparseTable")
  return table


def step_seconds(kernels: Iterable[step_census.Kernel], c: Constants,
                 table: SparseTable | None = None) -> float:
  """Seconds of one step: every launch, kernels of conditional branches left out (the
  common step; step_census.summarize)."""
  return sum(k.count * kernel_seconds(k, c, table) for k in kernels if not k.branch)


def by_category(kernels: Iterable[step_census.Kernel], c: Constants,
                table: SparseTable | None = None) -> dict[str, float]:
  out = {cat: 0.0 for cat in step_census.CATEGORIES}
  for k in kernels:
    if not k.branch:
      out[k.category] += k.count * kernel_seconds(k, c, table)
  return out


@dataclasses.dataclass(frozen=True)
class Row:
  """A measured step: its kernels and its time."""
  name: str
  kernels: tuple[step_census.Kernel, ...]
  seconds: float


class _Arrays:
  """A step's roofline kernels as arrays (the fit evaluates a step many times); the
  cuSPARSELt calls, few, stay kernels."""

  def __init__(self, kernels: Iterable[step_census.Kernel]):
    plain = [k for k in kernels if not k.branch and not _from_table(k)]
    self.table_kernels = [k for k in kernels if not k.branch and _from_table(k)]
    self.count = np.array([k.count for k in plain], float)
    self.flops = np.array([k.flops / (FP8_SPEEDUP if k.fp8_gemm else 1.0) for k in plain])
    self.bytes = np.array([k.bytes for k in plain], float)

  def seconds(self, c: Constants, table: SparseTable | None) -> float:
    t = np.maximum(self.flops / c.flops_per_s, self.bytes / c.bytes_per_s) + c.launch_s
    return float(np.dot(self.count, t)) + sum(
        k.count * kernel_seconds(k, c, table) for k in self.table_kernels)


def _from_table(k: step_census.Kernel) -> bool:
  return k.target.startswith("cusparselt") and k.category in (step_census.SPARSE_GEMM,
                                                               step_census.COMPRESSION)


def fit(rows: Sequence[Row], table: SparseTable | None = None, *,
        starts: int = 4) -> Constants:
  """F, B and c (within BOUNDS) minimizing sum((model / measured - 1)^2) over the rows."""
  from scipy import optimize   # pylint: disable=g-import-not-at-top (the fit only)
  lo = np.log([BOUNDS["flops_per_s"][0], BOUNDS["bytes_per_s"][0], 1e-9])
  hi = np.log([BOUNDS["flops_per_s"][1], BOUNDS["bytes_per_s"][1], BOUNDS["launch_s"][1]])
  arrays = [(_Arrays(r.kernels), r.seconds) for r in rows]

  def constants(p):   # log-parameters; c's lower end (1 ns) stands for 0
    return Constants(*np.exp(p))

  def residuals(p):
    c = constants(p)
    return np.array([a.seconds(c, table) / s - 1 for a, s in arrays])

  best = None
  # A few starts over the box: the max() makes the objective piecewise smooth.
  for frac in np.linspace(0.2, 0.8, starts):
    res = optimize.least_squares(residuals, lo + frac * (hi - lo), bounds=(lo, hi))
    if best is None or res.cost < best.cost:
      best = res
  return constants(best.x)
