"""Test helpers shared by tests/test_kernels_*.py (imports pytest; not used
by the kernels themselves).

Every kernel test body runs twice through the `MODES` parametrisation:
interpret=True on any machine, and interpret=False (native Triton) marked
`gpu`, which the root conftest skips unless jax's default backend is a GPU.
"""
from __future__ import annotations

import jax
import pytest

MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="native", marks=pytest.mark.gpu),
]

TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_gpu(fn, *args) -> str:
  """StableHLO text of fn(*args) lowered for CUDA, even on a CPU-only jaxlib.

  This runs the Pallas -> Triton-IR lowering (every Triton-backend rule:
  unsupported primitives, non-power-of-two tensors, bad dot shapes in the
  lowering's own checks) without a GPU. It does not run the Triton compiler,
  so what only ptxas would reject is still untested without a GPU.
  """
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


def assert_lowers_to_triton(fn, *args, expected_calls: int | None = None):
  text = lower_for_gpu(fn, *args)
  n = text.count(TRITON_CALL)
  assert n >= 1, "no Triton custom call in the lowered module"
  if expected_calls is not None:
    assert n == expected_calls, f"{n} Triton calls, expected {expected_calls}"
  return n
