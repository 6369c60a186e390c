"""What cuSPARSELt 0.10 accepts, written down once: the rules `Gemm.check` and the CPU stand-in
both enforce, so that every GEMM the CPU suite builds is one the library would plan.

Each rule names its source. [RUN]: the library's own host-side checks (its descriptor and
matmul-descriptor validation), run on a CPU machine against `libcusparseLt.so.0` of the pinned
wheel `nvidia-cusparselt-cu13==0.10.0` for SM 8.0 / 8.6 / 8.9 / 9.0, with the message the
library logs at `CUSPARSELT_LOG_LEVEL=1`. [BIN]: the kernel names and strings inside that
library. [DOC]: docs.nvidia.com/cuda/cusparselt (types.html, functions.html,
release_notes.html). [PT]: PyTorch's aten/src/ATen/native/sparse/cuda/cuSPARSELtOps.cpp.

  R1  A and B have the same value type (e4m3 x e5m2 is refused: "matA ({}) and matB ({}) with
      different value types is not supported") [RUN]; no mixed-type kernel exists [BIN].
  R2  The (A = B, D) types: bf16 -> bf16; f16 -> f16; f32 -> f32 (TF32); e4m3 / e5m2 -> f32,
      f16 or bf16; i8 -> i8, i32, f16, bf16; compute 32F (32I for i8). bf16 -> f32 and
      f16 -> f32 are refused ("matrix type/compute type combination is not supported") [RUN];
      no such kernel exists [BIN].
  R3  8-bit types take both operands contiguous along k only: with every matrix described
      column-major (ops.py) that is trans_a=True, trans_b=False, the "TN" layout ("only
      opA/B=TN is supported with orderA/B=(COL,COL) and AB_type = ...") [RUN]. 16-bit and f32
      take every layout.
  R4  D may be column- or row-major for every type [RUN, BIN].
  R5  The structured (2:4) operand: rows, columns and leading dimension multiples of 32 bytes'
      worth of elements (f32: 8, 16-bit: 16, 8-bit: 32); a dense operand: of 16 bytes' worth
      (f32: 4, 16-bit: 8, 8-bit: 16) ("the number of rows must be at least multiple of {} with
      data type {} and the matrix is sparse") [RUN; PT _DTYPE_SHAPE_CONSTRAINTS].
  R6  m and n of D at most 2,097,120 [RUN].
  R7  CUSPARSELT_SPARSITY_50_PERCENT is 2:4 for 16- and 8-bit types but 1:2 for float32 [DOC
      types.html]: a 2:4 group [a, b, 0, 0] is not 1:2, and compression would silently drop a
      value. s24jax's masks are 2:4, so float32 operands are refused.
  R8  Compute capability: 8.0+ for every type; e4m3 / e5m2 from 8.9 (L4, L40S; release notes
      0.8.0 "Introduced E4M3 and E5M2 kernels for SM 8.9") and 9.0 (H100) [DOC, BIN].
  R9  The compressed operand's size: PyTorch allocated numel * 9 / 16 elements for 16-bit
      types and numel * 10 / 16 for int8 (values: half; metadata: 2 bits per kept value, i.e.
      1/16 of a 16-bit and 2/16 of an 8-bit operand's bytes) [PT, before it asked
      cusparseLtSpMMACompressedSize2]. The FFI handler checks the library's own figure
      against this bound at run time and stops with a clear error if it does not fit.
  R10 Device pointers: the library refuses a d_A, d_B, d_C or d_D whose alignment is not a
      multiple of 16 bytes ("unsupported alignment value for d_A ({}), only multiples of 16
      are supported") [BIN]. For the workspace and the compression buffer no alignment was
      found stated (neither in the library's strings [BIN] nor in the parts of the docs read
      [DOC]). s24jax gives every scratch buffer 256 bytes (SCRATCH_ALIGNMENT): cuBLASLt
      documents at least 256 for its matmul workspace (cublasLtMatmul), and PyTorch's
      `_cslt_*` take the workspace and compression buffer from the CUDA caching allocator
      [PT], whose blocks are cudaMalloc segments (256-byte aligned) cut at multiples of 512
      bytes (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize).

XLA's side of the FFI contract, which the handlers (cusparselt_ffi.cc, scratch.h) live under.
[XLA]: openxla/xla, xla/ffi/ffi_api.cc, `XLA_FFI_DeviceMemory_Allocate` (read at commit
0e8e32a2); [ffi.h], [api.h]: xla/ffi/api/ of jaxlib 0.10.2 (`jax.ffi.include_dir()`), whose
`ScratchAllocator` and its decoding are those of openxla/xla's current ffi.h too.

  X1  Scratch alignment: `XLA_FFI_DeviceMemory_Allocate` refuses any alignment that is not a
      power of two or is above 16 (`kMaxAlignment = 16`; "Unsupported alignment: %d") [XLA];
      seen on an H100 with jaxlib 0.11.2 (2026-11-27), where the handlers asked for 256 and
      every cuSPARSELt call failed. So the handlers ask for bytes + 255 at alignment 16 and
      round the pointer up to 256 (scratch.h; tests/kernels/test_cusparselt_scratch.py).
  X2  Scratch exists only on a GPU: without XLA's GPU context the call fails ("XLA FFI GPU
      context is not available") [XLA]; a CPU handler gets none at any alignment (jaxlib
      0.10.2: `Allocate(1024, 16)` fails, checked for issue 35), so X1 is tested against a
      fake of XLA's C API.
  X3  `ffi::ScratchAllocator::Allocate` returns an empty optional on failure and writes XLA's
      message to the DiagnosticEngine it was decoded with [ffi.h]; XLA reads that engine only
      when decoding the handler's operands fails [api.h, Handler::Call]. The handlers decode
      the allocator with an engine of their own (scratch.h, `XlaScratch`) and put XLA's
      message, the buffer, its bytes and the alignment asked into their error.

Not checkable without a GPU, and so only written here: whether an algorithm (a kernel) exists
for a given shape on a given GPU (cusparseLtMatmulAlgSelectionInit / PlanInit), and the
minimum driver for FP8 on SM 8.9 / 9.0.
"""
from __future__ import annotations

import dataclasses
import math
import re

# Element types by the names the FFI attributes use (ops._DTYPE_NAMES).
TYPES_16 = ("bf16", "f16")
TYPES_8 = ("e4m3", "e5m2")
MAX_MN = 2_097_120                                   # R6
MIN_COMPUTE_CAPABILITY = (8, 0)                      # R8
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)                  # R8
SCRATCH_ALIGNMENT = 256                              # R10: what the handlers give every buffer
XLA_MAX_SCRATCH_ALIGNMENT = 16                       # X1


@dataclasses.dataclass(frozen=True)
class TypeRule:
  """What cuSPARSELt 0.10 does with one A/B value type."""
  name: str
  bytes: int                       # element size
  pattern: str                     # what CUSPARSELT_SPARSITY_50_PERCENT means for it (R7)
  outputs: tuple[str, ...]         # allowed D types (R2)
  k_major_only: bool               # R3: only the TN layout
  min_cc: tuple[int, int]          # R8

  @property
  def sparse_multiple(self) -> int:   # R5: the structured operand's dimensions
    return 32 // self.bytes

  @property
  def dense_multiple(self) -> int:    # R5: a dense operand's dimensions
    return 16 // self.bytes

  def compressed_bytes(self, numel: int) -> int:
    """R9: the bound of the compressed 2:4 operand of `numel` elements."""
    factor = 10 if self.bytes == 1 else 9
    return math.ceil(numel * self.bytes * factor / 16)


RULES = {
    "bf16": TypeRule("bf16", 2, "2:4", ("bf16",), False, MIN_COMPUTE_CAPABILITY),
    "f16": TypeRule("f16", 2, "2:4", ("f16",), False, MIN_COMPUTE_CAPABILITY),
    "f32": TypeRule("f32", 4, "1:2", ("f32",), False, MIN_COMPUTE_CAPABILITY),
    "e4m3": TypeRule("e4m3", 1, "2:4", ("f32", "f16", "bf16"), True,
                     FP8_MIN_COMPUTE_CAPABILITY),
    "e5m2": TypeRule("e5m2", 1, "2:4", ("f32", "f16", "bf16"), True,
                     FP8_MIN_COMPUTE_CAPABILITY),
}
ELEMENT_BYTES = {name: r.bytes for name, r in RULES.items()}


class RuleError(ValueError):
  """A GEMM cuSPARSELt 0.10 would refuse; the message names the rule (module docstring)."""


def rule(name: str) -> TypeRule:
  try:
    return RULES[name]
  except KeyError:
    raise RuleError(f"cuSPARSELt: value type {name!r} is not one s24jax uses; valid: "
                    f"{', '.join(RULES)}") from None


def check(what: str, *, m: int, n: int, k: int, trans_a: bool, trans_b: bool,
          a_type: str, b_type: str, d_type: str) -> None:
  """Raises RuleError, naming the rule, unless cuSPARSELt 0.10 accepts this GEMM: D (m x n) =
  op(A) (m x k, 2:4 along k) op(B) (k x n), every matrix described column-major."""
  ra, rb = rule(a_type), rule(b_type)
  where = (f"cuSPARSELt {what} (m={m}, n={n}, k={k}, "
           f"{'T' if trans_a else 'N'}{'N' if not trans_b else 'T'}, A {a_type}, B {b_type}, "
           f"D {d_type})")
  if a_type != b_type:
    raise RuleError(f"{where}: A and B must have the same value type (R1: the library "
                    "refuses mixed types, and ships no e4m3 x e5m2 kernel).")
  if ra.pattern != "2:4":
    raise RuleError(f"{where}: for {a_type} cuSPARSELt's 50% sparsity means {ra.pattern}, "
                    "not 2:4 (R7), so a 2:4 operand would be compressed wrongly; compute in "
                    "bfloat16 (model.dtype='bfloat16', or 'auto' on a GPU) or use "
                    "sparsity.backend='xla'.")
  if d_type not in ra.outputs:
    raise RuleError(f"{where}: {a_type} inputs write {', '.join(ra.outputs)} only (R2: no "
                    f"{a_type} -> {d_type} kernel).")
  if ra.k_major_only and not (trans_a and not trans_b):
    raise RuleError(f"{where}: {a_type} takes only the TN layout, both operands contiguous "
                    "along k (R3).")
  for name, value in (("m", m), ("k", k)):
    if value % ra.sparse_multiple:
      raise RuleError(f"{where}: {name}={value}, a dimension of the 2:4 operand, must be a "
                      f"multiple of {ra.sparse_multiple} for {a_type} (R5).")
  if n % rb.dense_multiple:
    raise RuleError(f"{where}: n={n}, a dimension of the dense operand, must be a multiple of "
                    f"{rb.dense_multiple} for {b_type} (R5).")
  rd = rule(d_type)
  for name, value in (("m", m), ("n", n)):
    if value % rd.dense_multiple:
      raise RuleError(f"{where}: {name}={value}, a dimension of D, must be a multiple of "
                      f"{rd.dense_multiple} for {d_type} (R5).")
    if value > MAX_MN:
      raise RuleError(f"{where}: {name}={value} exceeds the library's {MAX_MN} (R6).")


def check_compute_capability(a_type: str, cc: tuple[int, int], device_kind: str) -> str | None:
  """None if a GPU of compute capability `cc` runs `a_type` 2:4 GEMMs (R8), else why not."""
  r = rule(a_type)
  if cc >= r.min_cc:
    return None
  need = ".".join(map(str, r.min_cc))
  return (f"cuSPARSELt runs {a_type} 2:4 GEMMs from compute capability {need} (R8); this "
          f"process targets a {device_kind} (compute capability {'.'.join(map(str, cc))})")


# ---------------------------------------------------------------------------------------------
# Reading the cuSPARSELt calls of a compiled step back (XLA's optimized HLO text), to check
# what was really compiled against the rules: the planner's report and the `aot` tests.

_HLO_TYPES = {"bf16": "bf16", "f16": "f16", "f32": "f32", "f8e4m3fn": "e4m3", "f8e5m2": "e5m2"}
_CALL = re.compile(r'= (?P<out>\w+)\[[^\]]*\][^ ]* custom-call\(.*custom_call_target='
                   r'"(?P<target>cusparselt_\w+)".*operand_layout_constraints=\{(?P<ops>.*?)\}, api_version'
                   r'.*backend_config=\{(?P<attrs>[^}]*)\}')


def _attrs(text: str) -> dict[str, object]:
  out = {}
  for item in text.split(","):
    key, _, value = item.partition("=")
    value = value.strip().split(":")[0].strip().strip('"')
    out[key.strip()] = {"true": True, "false": False}.get(value, value)
  return out


def audit_hlo(text: str) -> list[dict[str, object]]:
  """Every cuSPARSELt compress and spmm call in an optimized HLO module's text (a search
  writes no GEMM, only the algorithm it found): its target, GEMM, types and
  the rule it breaks ('violation', None if it keeps them all; `check` and, for a compress,
  the compressed buffer's size R9)."""
  calls = []
  for line in text.splitlines():
    match = _CALL.search(line)
    if not match or match["target"] == "cusparselt_search":   # finds an algorithm: no GEMM out
      continue
    attrs = _attrs(match["attrs"])
    operands = [o.split("[")[0].strip() for o in re.findall(r"\w+\[[^\]]*\]", match["ops"])]
    gemm = {k: int(attrs[k]) for k in ("m", "n", "k")}
    gemm.update(trans_a=bool(attrs["trans_a"]), trans_b=bool(attrs["trans_b"]))
    if match["target"].endswith("compress"):
      types = dict(a_type=_HLO_TYPES.get(operands[0], operands[0]),
                   b_type=str(attrs["b_dtype"]), d_type=str(attrs["d_dtype"]))
    else:
      types = dict(a_type=str(attrs["a_dtype"]), b_type=_HLO_TYPES.get(operands[1], operands[1]),
                   d_type=_HLO_TYPES.get(match["out"], match["out"]))
    call = {"target": match["target"], **gemm, **types, "violation": None}
    try:
      check(match["target"], **gemm, **types)
      if match["target"].endswith("compress"):
        size = int(re.search(r"u8\[(\d+)\]", line).group(1))
        want = rule(types["a_type"]).compressed_bytes(gemm["m"] * gemm["k"])
        if size != want:
          raise RuleError(f"compressed buffer of {size} bytes, the bound is {want} (R9)")
    except RuleError as e:
      call["violation"] = str(e)
    calls.append(call)
  return calls
