"""The GEMM section's rows: which, in which order, how many calls each timed loop makes, and
what a row is expected to cost (to skip one that cannot finish before the deadline).

A row is one GEMM of a sparse layer: its kind (forward, dgrad, wgrad), the layer W~ (N, K) of
a model's FFN (GPT-2-style widths d with hidden 4d, and Llama 7B's FFN, width 4096 and hidden
11008: matrix 'fc' is (hidden, width), 'proj' (width, hidden)), the tokens of a micro-batch
and the precision (bf16, or FP8: the forward e4m3, the backward e5m2, as the op runs them).

Order: most informative first (HEAD, all at 65536 tokens: 124M's FFN, which the steps and the
H200 run of 2026-11-27 measured, and Llama 7B's, whose train step the issue judges, in bf16;
then the widest layer (8192), both in FP8, 4096 and 1.5B's width 1600); then every other
combination. A row that does not fit in what is left is recorded as skipped and the next
(perhaps smaller) one is tried: by these estimates a width-8192 row costs ~35 s (the search's
SEARCH_CALLS calls of a 0.1 s GEMM), a 124M row ~5 s, a Llama one ~10 s.

Every estimate here is a guess from datasheets, never measured on a GPU in this form: a GEMM at
ASSUMED_FLOPS, s24jax's compression at ASSUMED_BANDWIDTH, the library's compression at
LIBRARY_COMPRESS_BANDWIDTH (the H200 run of 2026-11-27 timed it at 6.1 ms for the
(3072, 65536) MVUE estimate: about 100 GB/s), the library's algorithm search at SEARCH_CALLS
GEMM calls (cuSPARSELt times every algorithm id, 5 iterations each by default; 0.6.2 had 37
ids), and ROW_COMPILE_SECONDS for the row's programs (the operands, the compression
beforehand, the search, the check's GEMMs, the timed program). Each row records its seconds,
so a GPU run says what to set them to.
"""
from __future__ import annotations

import dataclasses
import math

from s24jax.perf.gpu_report import bandwidth

WIDTHS = (768, 1024, 1600, 2048, 4096, 8192)
LLAMA_7B = (4096, 11008)      # (width, FFN hidden), s24jax/training/config.py LLAMA_SIZES / llama.py
TOKENS = (65536, 8192)
KINDS = ("forward", "dgrad", "wgrad")
# What a row times (gemms.py's docstring says what each is).
VARIANTS = ("sparse", "sparse_searched", "compress_s24jax", "compress_library",
            "compress_s24jax+sparse", "compress_library+sparse", "dense_xla")
MATRICES = ("fc", "proj")
PRECISIONS = ("bf16", "fp8")
# (width, hidden, tokens, precision) groups run first, each with both matrices and all kinds.
HEAD = ((768, 4 * 768, 65536, "bf16"), (*LLAMA_7B, 65536, "bf16"),
        (8192, 4 * 8192, 65536, "bf16"), (768, 4 * 768, 65536, "fp8"),
        (*LLAMA_7B, 65536, "fp8"), (8192, 4 * 8192, 65536, "fp8"),
        (4096, 4 * 4096, 65536, "bf16"), (1600, 4 * 1600, 65536, "bf16"))
SMOKE = ((64, 256, 256, "bf16"), (64, 256, 256, "fp8"))

REPEATS = 3                  # timed loops per variant, after one warm-up loop
LOOP_SECONDS = 0.02          # a timed loop's target length
MIN_CALLS, MAX_CALLS = 2, 200
MIN_CALL_SECONDS = 20e-6     # a call takes at least this (launch and tail)
ASSUMED_FLOPS = 300e12       # an H100's dense bf16 GEMMs run at 400-700 TFLOP/s
ASSUMED_BANDWIDTH = 2.5e12   # s24jax's compression (an H100's HBM: 3.35 TB/s)
LIBRARY_COMPRESS_BANDWIDTH = 0.1e12
SEARCH_CALLS = 200
ROW_COMPILE_SECONDS = 5.0
# The check's float32 (Precision.HIGHEST) product against a bf16 GEMM: an H100's peaks are
# ~67 and ~990 TFLOP/s; a guess of 8x in practice (large float32 GEMMs run nearer their peak).
CHECK_F32_SLOWDOWN = 8.0
SMOKE_ROW_SECONDS = 15.0


@dataclasses.dataclass(frozen=True)
class Row:
  kind: str
  width: int
  hidden: int
  tokens: int
  matrix: str
  precision: str

  @property
  def shape_nk(self) -> tuple[int, int]:
    """W~ (N, K) of the layer."""
    return (self.hidden, self.width) if self.matrix == "fc" else (self.width, self.hidden)

  @property
  def name(self) -> str:
    return (f"{self.kind} d={self.width} hidden={self.hidden} t={self.tokens} {self.matrix} "
            f"{self.precision}")

  def fields(self) -> dict:
    return dict(kind=self.kind, width=self.width, hidden=self.hidden, tokens=self.tokens,
                matrix=self.matrix, shape_NK=list(self.shape_nk), precision=self.precision)


def _rows(groups) -> list[Row]:
  return [Row(kind, d, h, t, matrix, p) for d, h, t, p in groups for matrix in MATRICES
          for kind in KINDS]


def plan(smoke: bool) -> list[Row]:
  """Every row in the order it runs (module docstring)."""
  if smoke:
    return _rows(SMOKE)
  shapes = [(d, 4 * d) for d in reversed(WIDTHS)] + [LLAMA_7B]
  rest = [(d, h, t, p) for p in PRECISIONS for t in TOKENS for d, h in shapes]
  return _rows(HEAD + tuple(g for g in rest if g not in HEAD))


def gemm_seconds(m: int, n: int, k: int) -> float:
  """The guess for one GEMM call D (m, n) = op(A) (m, k) op(B) (k, n) (module docstring)."""
  return max(2 * m * n * k / ASSUMED_FLOPS, MIN_CALL_SECONDS)


def compress_seconds(m: int, k: int, itemsize: int, *, library: bool) -> float:
  """The guess for one compression of op(A) (m, k): one read of it, one write of the result."""
  moved = sum(bandwidth.compression_bytes(m, k, itemsize))
  return max(moved / (LIBRARY_COMPRESS_BANDWIDTH if library else ASSUMED_BANDWIDTH),
             MIN_CALL_SECONDS)


def gemm_dims(row: Row) -> tuple[int, int, int]:
  """(m, n, k) of the row's GEMM D (m, n) = op(A) (m, k) op(B) (k, n) (dX's is the same
  whether its A is W~^T or W~ itself)."""
  n, k = row.shape_nk
  return {"forward": (n, row.tokens, k), "dgrad": (k, row.tokens, n),
          "wgrad": (n, k, row.tokens)}[row.kind]


def variant_seconds(m: int, n: int, k: int, itemsize: int) -> dict[str, float]:
  """The guess for one call of each of VARIANTS on a GEMM (m, n, k) with A of `itemsize`."""
  gemm = gemm_seconds(m, n, k)
  ours = compress_seconds(m, k, itemsize, library=False)
  theirs = compress_seconds(m, k, itemsize, library=True)
  return {"sparse": gemm, "sparse_searched": gemm, "compress_s24jax": ours,
          "compress_library": theirs, "compress_s24jax+sparse": ours + gemm,
          "compress_library+sparse": theirs + gemm, "dense_xla": gemm}


def calls_for(seconds_per_call: float, smoke: bool) -> int:
  """Calls in one timed loop of a variant taking `seconds_per_call`: about LOOP_SECONDS."""
  if smoke:
    return MIN_CALLS
  return int(min(MAX_CALLS, max(MIN_CALLS, math.ceil(LOOP_SECONDS / seconds_per_call))))


def check_seconds(m: int, n: int, k: int) -> float:
  """The guess for algorithms.check_against_default on the GEMM: the GEMM under the
  algorithm and under the default, the identity read-back of op(A) (m, k) (a GEMM with n = k),
  and the bound's float32 product (Precision.HIGHEST: ~CHECK_F32_SLOWDOWN x a bf16 GEMM)."""
  return (2 * gemm_seconds(m, n, k) + gemm_seconds(m, k, k)
          + CHECK_F32_SLOWDOWN * gemm_seconds(m, n, k))


def row_seconds(per_call: dict[str, float], gemm_call: float, extra: float, torch_peer: bool,
                smoke: bool) -> float:
  """A row's expected cost: ROW_COMPILE_SECONDS, every variant's REPEATS + 1 loops
  (`per_call`: variant -> seconds a call), the search (SEARCH_CALLS GEMM calls), `extra`
  seconds (check_seconds where the check runs) and the torch peer's 2 variants."""
  if smoke:
    return SMOKE_ROW_SECONDS
  loops = sum((REPEATS + 1) * calls_for(s, False) * s for s in per_call.values())
  peer = 2 * (REPEATS + 1) * calls_for(gemm_call, False) * gemm_call if torch_peer else 0.0
  return ROW_COMPILE_SECONDS + loops + SEARCH_CALLS * gemm_call + extra + peer
