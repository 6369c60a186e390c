"""Tests for s24jax/nn/activations.py, the FFN activations: the fused gated custom_vjp (geglu,
swiglu) against JAX's autodiff of the formula written out here, in float32 and bfloat16."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.nn import activations


def _plain_gated(kind, h):
  """value * act(gate) for h = [value | gate], written out, differentiated by JAX itself."""
  hidden = h.shape[-1] // 2
  value, gate = h[..., :hidden], h[..., hidden:]
  if kind == "geglu":   # tanh-approximate GELU, written out rather than jax.nn.gelu
    act = 0.5 * gate * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
  else:                 # swiglu: SiLU = gate * sigmoid(gate)
    act = gate / (1 + jnp.exp(-gate))
  return value * act


@pytest.mark.parametrize("kind", ["geglu", "swiglu"])
def test_gated_act_custom_vjp_matches_autodiff_of_the_formula(kind):
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.standard_normal((2, 3, 16)) * 2, jnp.float32)   # (B, T, 2H), H = 8
  dy = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)       # (B, T, H)
  y, vjp = jax.vjp(lambda h: activations.gated_act(kind, h), h)
  y_ref, vjp_ref = jax.vjp(lambda h: _plain_gated(kind, h), h)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(vjp(dy)[0], vjp_ref(dy)[0], rtol=1e-5, atol=1e-6)
  # and jax.grad of a scalar loss, through jit, as training uses it
  loss = lambda f: jax.jit(jax.grad(lambda h: jnp.sum(jnp.sin(f(h)))))
  np.testing.assert_allclose(loss(lambda h: activations.apply(kind, h))(h),
                             loss(lambda h: _plain_gated(kind, h))(h), rtol=1e-5, atol=1e-6)


def test_gated_act_bfloat16_gradient_close_to_float32():
  """bf16 inputs (the GPU compute dtype): computed in float32 inside, cast once at the end."""
  rng = np.random.default_rng(1)
  h = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
  g32 = jax.vjp(lambda h: activations.gated_act("swiglu", h), h)[1](dy)[0]
  g16 = jax.vjp(lambda h: activations.gated_act("swiglu", h), h.astype(jnp.bfloat16))[1](
      dy.astype(jnp.bfloat16))[0]
  assert g16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(g16, np.float32), g32, rtol=2e-2, atol=2e-2)
