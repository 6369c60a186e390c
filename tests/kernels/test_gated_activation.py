"""Tests of s24jax.kernels.gated_activation: the fused GEGLU / SwiGLU forward and custom_vjp
backward, against NumPy float64 formulas (erf / tanh GELU, SiLU) and the jnp reference."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import gated_activation
from s24jax.kernels import gated_activation as ga
from s24jax.kernels._testing import MODES
from s24jax.kernels._testing import assert_lowers_to_triton

CFG = ga.GatedActConfig()
VARIANTS = [("geglu", True), ("geglu", False), ("swiglu", True)]


def _np_gated(x, kind, approximate):
  x = np.asarray(x, np.float64)
  h = x.shape[-1] // 2
  v, g = x[..., :h], x[..., h:]
  if kind == "swiglu":
    act = g / (1 + np.exp(-g))
  elif approximate:
    act = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
  else:
    act = 0.5 * g * (1 + np.vectorize(math.erf)(g / math.sqrt(2)))
  return v * act


# Every variant on an aligned shape; a ragged, batched shape (T = 15 rows,
# padded; H = 12 not a multiple of the block) for one of them.
CASES = [(v, (16, 64)) for v in VARIANTS] + [(VARIANTS[0], (3, 5, 24))]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("variant,shape", CASES)
def test_forward_and_grad(interpret, variant, shape):
  kind, approximate = variant
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32) * 2
  f = functools.partial(ga._gated_act, kind=kind, approximate=approximate,
                        config=CFG, interpret=interpret, poison=True)
  ref = functools.partial(ga.gated_act_reference, kind=kind,
                          approximate=approximate)
  y = f(x)
  assert y.shape == shape[:-1] + (shape[-1] // 2,)
  # f32 vs float64: 1 + tanh(u) cancels for very negative gates.
  np.testing.assert_allclose(np.asarray(y), _np_gated(x, kind, approximate),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(y), np.asarray(jax.jit(ref)(x)),
                             rtol=1e-5, atol=1e-5)
  dy = jax.random.normal(jax.random.key(1), y.shape, jnp.float32)
  loss = lambda fn: (lambda x: jnp.sum(fn(x) * dy))
  g = jax.grad(loss(f))(x)
  gr = jax.jit(jax.grad(loss(ref)))(x)
  np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("interpret", MODES)
def test_matches_project_activation_bf16(interpret):
  """Drop-in for s24jax.nn.activations.gated_act (h = [value | gate])."""
  acts = pytest.importorskip("s24jax.nn.activations")
  x = jax.random.normal(jax.random.key(2), (2, 8, 64), jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(3), (2, 8, 32), jnp.bfloat16)
  for kind in ("geglu", "swiglu"):
    y, vjp = jax.vjp(lambda x: gated_activation.gated_act(x, kind, interpret=interpret),
                     x)
    yr, vjpr = jax.vjp(lambda x: acts.gated_act(kind, x), x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32),
                               np.asarray(yr, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(vjp(dy)[0], np.float32),
                               np.asarray(vjpr(dy)[0], np.float32),
                               rtol=1e-2, atol=2e-2)


def test_bad_inputs_are_errors():
  with pytest.raises(ValueError, match="even"):
    gated_activation.gated_act(jnp.ones((4, 7)), interpret=True)
  with pytest.raises(ValueError, match="unknown gated activation"):
    gated_activation.gated_act(jnp.ones((4, 8)), "reglu", interpret=True)


@pytest.mark.parametrize("kind,approximate", VARIANTS)
def test_lowers_to_triton(kind, approximate):
  x = jnp.ones((64, 2 * 3072), jnp.bfloat16)

  def loss(x):
    return gated_activation.gated_act(x, kind, approximate=approximate).astype(
        jnp.float32).sum()
  assert_lowers_to_triton(jax.value_and_grad(loss), x, expected_calls=2)
