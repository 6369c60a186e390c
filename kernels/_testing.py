"""Test helpers shared by tests/test_kernels_*.py (imports pytest; not used
by the kernels themselves).

The NumPy codecs of the 2:4 metadata format (`np_pack_meta`,
`np_unpack_meta`, `np_decompress`) are written straight from the format's
description in `kernels/_common.py`, loop by loop, as an independent check of
the jnp / in-kernel packing.

Every kernel test body runs twice through the `MODES` parametrisation:
interpret=True on any machine, and interpret=False (native Triton) marked
`gpu`, which the root conftest skips unless jax's default backend is a GPU.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from . import _common as c

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


def np_pack_meta(idx, k: int) -> np.ndarray:
  """idx [rows, G, 2] sorted kept positions -> meta [rows, ceil(K/32)] uint32."""
  idx = np.asarray(idx)
  rows, g, _ = idx.shape
  meta = np.zeros((rows, c.meta_words(k)), np.uint64)
  for r in range(rows):
    for q in range(meta.shape[1]):
      word = 0
      for s in range(c.GROUPS_PER_WORD):
        gi = c.GROUPS_PER_WORD * q + s
        nib = ((int(idx[r, gi, 0]) | (int(idx[r, gi, 1]) << 2)) if gi < g
               else c.EMPTY_NIBBLE)
        word |= nib << (4 * s)
      meta[r, q] = word
  return meta.astype(np.uint32)


def np_unpack_meta(meta, k: int) -> np.ndarray:
  """meta [rows, ceil(K/32)] -> idx [rows, K/4, 2] (i0, i1) per group."""
  meta = np.asarray(meta)
  rows, g = meta.shape[0], k // 4
  idx = np.zeros((rows, g, 2), np.int64)
  for r in range(rows):
    for gi in range(g):
      nib = (int(meta[r, gi // c.GROUPS_PER_WORD])
             >> (4 * (gi % c.GROUPS_PER_WORD))) & 15
      idx[r, gi] = (nib & 3, nib >> 2)
  return idx


def np_decompress(values, meta) -> np.ndarray:
  """(values [rows, K/2], meta) -> dense [rows, K] float32."""
  values = np.asarray(values, np.float32)
  rows, half = values.shape
  idx = np_unpack_meta(meta, 2 * half)
  w = np.zeros((rows, 2 * half), np.float32)
  for r in range(rows):
    for g in range(half // 2):
      w[r, 4 * g + idx[r, g, 0]] = values[r, 2 * g]
      w[r, 4 * g + idx[r, g, 1]] = values[r, 2 * g + 1]
  return w
