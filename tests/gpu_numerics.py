"""A GPU's default numerics on a CPU, to find the tests that hold only at CPU precision.

  S24JAX_TEST_GPU_NUMERICS=1 python -m pytest -q -n 2 -m "not slow"

On an NVIDIA GPU from Ampere on, two things differ from a CPU run of the same code, and both
are invisible on the CPU the suite normally runs on:

  * XLA runs float32 dots in TF32 unless the dot's precision (or
    `jax.default_matmul_precision`) says otherwise: each operand keeps 10 of its 23 mantissa
    bits (relative rounding error up to 2^-11), the products are accumulated in float32.
  * `model.dtype='auto'` is bfloat16 (s24jax.nn.layers.compute_dtype), float32 on a CPU.

With the variable set, conftest.py installs both here: every dot_general whose precision is
DEFAULT gets its float32 operands rounded to TF32 (lax.reduce_precision, round to nearest
even; the backward pass's dots are rounded the same way), and 'auto' resolves
to bfloat16. A test that passes under this and fails on a GPU has another cause (the
Pallas kernels run natively, cuDNN attention, FP8 tensor cores, reduction order); one that
fails under this would fail on a GPU. It is a check of the tests, not of s24jax: nothing in
the library reads the variable.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

ENV = "S24JAX_TEST_GPU_NUMERICS"
TF32_MANTISSA_BITS = 10


def enabled() -> bool:
  return os.environ.get(ENV, "") not in ("", "0")


def _tf32(x):
  if getattr(x, "dtype", None) != jnp.float32:
    return x
  # Linear in x (jax differentiates it as the identity rounded), so tangents and cotangents
  # going through a dot are rounded too, as the GPU's backward dots round theirs.
  return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=TF32_MANTISSA_BITS)


def _is_default(precision) -> bool:
  if precision is None:
    return True
  parts = precision if isinstance(precision, tuple) else (precision,)
  return all(p in (None, lax.Precision.DEFAULT) for p in parts)


def install() -> None:
  """TF32 for DEFAULT-precision float32 dots, bfloat16 for model.dtype='auto'."""
  from jax._src.lax import lax as lax_internal  # pylint: disable=g-import-not-at-top
  from s24jax.nn import layers
  from s24jax.nn import llama
  from s24jax.nn import model  # pylint: disable=g-import-not-at-top

  primitive = lax_internal.dot_general_p
  bind = primitive.bind

  def tf32_bind(lhs, rhs, **params):
    if _is_default(params.get("precision")):
      lhs, rhs = _tf32(lhs), _tf32(rhs)
    return bind(lhs, rhs, **params)

  primitive.bind = tf32_bind

  def compute_dtype(name: str):
    return jnp.bfloat16 if name == "auto" else jnp.dtype(name)

  for module in (layers, llama, model):
    module.compute_dtype = compute_dtype

