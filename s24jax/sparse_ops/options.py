"""The static options of the sparse linear op's three GEMMs, built once per model.

`GemmOptions` is what every backend receives (a hashable, non-differentiable argument of its
custom_vjp). The model builds it once from its frozen `SparsityConfig`
(`SparsityConfig.gemm`); nothing else assembles it from loose flags.
"""
from __future__ import annotations

import dataclasses

from s24jax.sparse_ops import gemm_choice

# sparsity.fp8_backward_operands: the FP8 format of W~ (dX = dY W~) and x (dW = est(dY^T) x)
# in the backward GEMMs, dY being e5m2. 'e4m3': as in the forward (every FP8 GEMM then has an
# e4m3 operand, what cuBLASLt's FP8 GEMMs take). 'e5m2': re-quantized like dY (the S-STE
# reference; one type per GEMM, what cuSPARSELt's take). 'auto' (the config's default) is the
# backend's own choice (`Backend.fp8_backward`): 'e4m3' on 'xla', 'e5m2' on 'cusparselt'.
FP8_BACKWARD_OPERANDS = ("e4m3", "e5m2")
FP8_BACKWARD_AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class GemmOptions:
  """How the three GEMMs of a sparse layer run (docs/algorithms.md, "The sparse linear op").

  The backend-independent checks are here; what a backend cannot do, it refuses itself
  (`Backend.check`, called by `sparse_ops.check`)."""
  mvue: bool = False        # weight gradient from the MVUE 2:4 estimate of dY^T
  fp8: bool = False         # FP8 GEMMs (s24jax/sparse_ops/fp8.py): e4m3 x and W~, e5m2 dY
  # FP8 format of W~ and x in the two backward GEMMs (FP8_BACKWARD_OPERANDS).
  fp8_backward_operands: str = "e4m3"
  backend: str = "xla"      # the implementation (sparse_ops.available_backends())
  # W~ is 2:4 along `out` too (a transposable mask, Method.transposable): the data-gradient
  # GEMM may then run sparse ('tcgen05', 'cusparselt'); otherwise it is dense.
  transposable: bool = False
  # Set inside shard_map by a backend that runs per device (cusparselt): the mesh axes the
  # tokens are split over, so that FP8's per-tensor amax is the whole tensor's (a pmax).
  token_axes: tuple[str, ...] = ()
  # Which GEMMs run on the backend's 2:4 kernel (gemm_choice.py; consulted by 'cusparselt'):
  # 'sparse' here, every one it can, as a direct call of the op asks; a run's config
  # (SparsityConfig.gemm_choice) defaults to 'measured'. gemm_table: a file of measured
  # times (gemm_times.TABLE_FORMAT), '' for none.
  gemm_choice: str = "sparse"
  gemm_table: str = ""

  def __post_init__(self):
    gemm_choice.check(self.gemm_choice)
    value = self.fp8_backward_operands
    if value not in FP8_BACKWARD_OPERANDS:
      raise ValueError(f"unknown sparsity.fp8_backward_operands {value!r}; valid: "
                       f"{', '.join(FP8_BACKWARD_OPERANDS)}")
    # Not a silent no-op: asking for e5m2 backward operands means an FP8 run was intended.
    if value != "e4m3" and not self.fp8:
      raise ValueError(f"sparsity.fp8_backward_operands={value!r} sets a format of the FP8 "
                       "backward GEMMs, but sparsity.fp8 is False: set sparsity.fp8=True, or "
                       "leave it at 'e4m3'.")
