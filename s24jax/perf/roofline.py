"""A step's time from its kernels (`step_census.Kernel`): a roofline per kernel, with three
global constants, and measured times for the kernels a roofline cannot know (cuSPARSELt).

Per launch of a kernel:

  t = max(FLOPs / F_k, bytes / B) + c

  F   achieved FLOP/s of the bf16 GEMMs and attention (F_k = FP8_SPEEDUP x F for a GEMM
      with FP8 operands: Hopper's FP8 tensor cores have twice the bf16 peak); every other
      kernel's FLOPs count against F too (they never bind: a few FLOPs per byte)
  B   achieved memory bandwidth (bytes: operands and outputs, `step_census`)
  c   a per-kernel cost (launch and tail)

The cuSPARSELt FFI calls are opaque to XLA; their times come from a measured table
(`SparseTable`, the GEMM rows of one GPU's run), scaled to the call's shape from the measured
row of the same GEMM kind (forward, dgrad, wgrad) and precision (bf16, FP8) nearest to the
call's (M, N, K) (the sum of |log| of the three ratios; several measurements of that shape
averaged):

  spmm      (sparse_ms - d) x FLOPs / FLOPs_measured + c, where d is the dispatch cost a
            single jitted call timed on the host holds (`host_timed`): dense_ms - (the
            model's time of the dense GEMM of the measured product), at least 0; d = 0 for
            rows timed as many calls in one jitted loop.
  compress  compress_ms x bytes / bytes_measured + c (compress_ms is a difference of two
            timings, so a dispatch cancels): W~ and W~^T (outside the backward) from the
            nearest forward or data-gradient row, the MVUE estimate (in the backward) from
            the nearest weight-gradient row.

Both scalings (time proportional to FLOPs, to bytes) are a stated rule, not a measurement:
a shape other than the measured one is a prediction. `fit` finds F, B and c that minimize
the squared relative error over measured step times (`Row`) of one GPU, within bounds set by
that GPU's peaks (`bounds`): the model is per device, fitted per device.
"""
from __future__ import annotations

if __name__ == "__main__":   # before the imports: Ctrl-C while starting is one line, exit 75
  from s24jax.cli import command
  command.guard_startup("s24jax.perf.roofline")

import dataclasses
from typing import Iterable, Sequence

import numpy as np

from s24jax.perf import step_census

FP8_SPEEDUP = 2.0
GEMM_KINDS = ("forward", "dgrad", "wgrad")
LAUNCH_S_MAX = 100e-6   # the per-kernel cost's upper bound


def bounds(peak_flops_per_s: float, peak_bytes_per_s: float) -> dict[str, tuple[float, float]]:
  """The fit's search range (not a claim) on a GPU of this dense bf16 peak and memory
  bandwidth."""
  return {"flops_per_s": (50e12, peak_flops_per_s), "bytes_per_s": (0.2e12, peak_bytes_per_s),
          "launch_s": (0.0, LAUNCH_S_MAX)}


BOUNDS = bounds(989e12, 3.35e12)   # an H100 SXM's: 989 TFLOP/s, 3.35 TB/s (HBM3)


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
  """One measured cuSPARSELt GEMM (milliseconds per call)."""
  kind: str              # forward, dgrad, wgrad
  precision: str         # bf16, fp8
  m: int                 # the library's M, N, K of the call
  n: int
  k: int
  sparse_ms: float       # kernel on an operand compressed beforehand
  compress_ms: float     # one compression of the sparse operand (A, m x k)
  dense_ms: float        # the dense XLA GEMM of the same product...
  dense_precision: str = "bf16"   # ... in bf16 or with FP8 operands
  host_timed: bool = True         # single calls timed on the host (else: a jitted loop's mean)

  @property
  def mnk(self) -> tuple[int, int, int]:
    return (self.m, self.n, self.k)

  @property
  def flops(self) -> float:
    return 2.0 * self.m * self.n * self.k

  @property
  def a_bytes(self) -> float:
    return self.m * self.k * (1 if self.precision == "fp8" else 2)


class MissingGemm(KeyError):
  """The table has no measured GEMM of a call's kind and precision."""


@dataclasses.dataclass(frozen=True)
class SparseTable:
  gemms: tuple[SparseGemm, ...]

  def get(self, kind: str, precision: str, mnk=None, kinds: tuple[str, ...] = ()) -> SparseGemm:
    """The measured GEMM of `kind` (or any of `kinds`) and `precision` nearest to the shape
    `mnk` (None: the first measured); several measurements of that shape averaged."""
    rows = [g for g in self.gemms if g.kind in (kinds or (kind,)) and g.precision == precision]
    if not rows:
      raise MissingGemm(f"no measured cuSPARSELt {'/'.join(kinds or (kind,))} GEMM in {precision}")
    if mnk is None:
      return rows[0]
    distance = [sum(abs(np.log(a / b)) for a, b in zip(mnk, g.mnk)) for g in rows]
    near = [g for g, d in zip(rows, distance) if np.isclose(d, min(distance))]
    near = [g for g in near if g.mnk == near[0].mnk]
    if len(near) == 1:
      return near[0]
    return dataclasses.replace(near[0], **{
        f: float(np.mean([getattr(g, f) for g in near]))
        for f in ("sparse_ms", "compress_ms", "dense_ms")})


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
  if _from_table(kernel):
    return _table_seconds(kernel, table_row(kernel, table), c)
  rate = c.flops_per_s * (FP8_SPEEDUP if kernel.fp8_gemm else 1.0)
  return max(kernel.flops / rate, kernel.bytes / c.bytes_per_s) + c.launch_s


def table_row(kernel: step_census.Kernel, table: SparseTable | None) -> SparseGemm:
  """The measured GEMM a cuSPARSELt call's time is scaled from (the module docstring)."""
  if table is None:
    raise ValueError("the step has cuSPARSELt calls: their times need a measured SparseTable")
  if kernel.category == step_census.SPARSE_GEMM:
    return table.get(gemm_kind(kernel), precision(kernel), kernel.gemm_mnk)
  # A compression: the MVUE estimate (per micro-batch, in the backward), or W~ / W~^T.
  kinds = ("wgrad",) if "transpose(" in kernel.op_name else ("forward", "dgrad")
  return table.get(kinds[0], precision(kernel), _ffi_mnk(kernel), kinds)


def _table_seconds(kernel: step_census.Kernel, g: SparseGemm, c: Constants) -> float:
  if kernel.category == step_census.SPARSE_GEMM:
    dispatch = max(0.0, g.dense_ms * 1e-3 - _dense_model_s(g, c)) if g.host_timed else 0.0
    kernel_s = max(g.sparse_ms * 1e-3 - dispatch, 0.0)
    return kernel_s * kernel.flops / g.flops + c.launch_s
  return kernel.operand_bytes * (g.compress_ms * 1e-3) / g.a_bytes + c.launch_s


def _ffi_mnk(kernel: step_census.Kernel) -> tuple[int, int, int] | None:
  """The (M, N, K) of the GEMM a cuSPARSELt compression serves (its FFI attributes)."""
  a = kernel.attributes
  return tuple(int(a[d]) for d in "mnk") if all(d in a for d in "mnk") else None


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
  cuSPARSELt calls, few, stay kernels, each with its measured row looked up once."""

  def __init__(self, kernels: Iterable[step_census.Kernel], table: SparseTable | None):
    plain = [k for k in kernels if not k.branch and not _from_table(k)]
    self.table_kernels = [(k, table_row(k, table)) for k in kernels
                          if not k.branch and _from_table(k)]
    self.count = np.array([k.count for k in plain], float)
    self.flops = np.array([k.flops / (FP8_SPEEDUP if k.fp8_gemm else 1.0) for k in plain])
    self.bytes = np.array([k.bytes for k in plain], float)

  def seconds(self, c: Constants) -> float:
    t = np.maximum(self.flops / c.flops_per_s, self.bytes / c.bytes_per_s) + c.launch_s
    return float(np.dot(self.count, t)) + sum(
        k.count * _table_seconds(k, g, c) for k, g in self.table_kernels)


def _from_table(k: step_census.Kernel) -> bool:
  return k.target.startswith("cusparselt") and k.category in (step_census.SPARSE_GEMM,
                                                               step_census.COMPRESSION)


def fit(rows: Sequence[Row], table: SparseTable | None = None, *, starts: int = 4,
        limits: dict[str, tuple[float, float]] | None = None) -> Constants:
  """F, B and c (within `limits`, default BOUNDS) minimizing sum((model / measured - 1)^2)
  over the rows."""
  from scipy import optimize   # pylint: disable=g-import-not-at-top (the fit only)
  limits = limits or BOUNDS
  lo = np.log([limits["flops_per_s"][0], limits["bytes_per_s"][0], 1e-9])
  hi = np.log([limits["flops_per_s"][1], limits["bytes_per_s"][1], limits["launch_s"][1]])
  arrays = [(_Arrays(r.kernels, table), r.seconds) for r in rows]

  def constants(p):   # log-parameters; c's lower end (1 ns) stands for 0
    return Constants(*np.exp(p))

  def residuals(p):
    c = constants(p)
    return np.array([a.seconds(c) / s - 1 for a, s in arrays])

  best = None
  # A few starts over the box: the max() makes the objective piecewise smooth.
  for frac in np.linspace(0.2, 0.8, starts):
    res = optimize.least_squares(residuals, lo + frac * (hi - lo), bounds=(lo, hi))
    if best is None or res.cost < best.cost:
      best = res
  return constants(best.x)


if __name__ == "__main__":   # a part of a tool: --help says which (not_a_command.py)
  from s24jax.perf import not_a_command
  raise SystemExit(not_a_command.answer(
      "s24jax.perf.roofline", __doc__,
      "python -m s24jax.perf.step_time report"))
