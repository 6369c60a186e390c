"""FFN activations: gelu, relu, relu2 (Squared-ReLU), and the gated geglu / swiglu.

Gated activations take fc's output h = [value | gate] (..., 2H) and return
value * act(gate) (..., H). `gated_act` is a custom_vjp whose backward recomputes act(gate)
from the saved input, reading the value and gate halves together (Hu et al. 2024 fuse this
to avoid a second pass over memory; a Pallas kernel can replace `_gated_fwd_bwd` here).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

GATED = ("geglu", "swiglu")


def relu2(x: jax.Array) -> jax.Array:
  """Squared ReLU, relu(x)^2 (So et al. 2021; Haziza et al. 2025)."""
  r = jax.nn.relu(x)
  return r * r


def _gate_fn(kind: str):
  return {"geglu": functools.partial(jax.nn.gelu, approximate=True),
          "swiglu": jax.nn.silu}[kind]


def _gated_fwd_bwd(kind: str, h: jax.Array, dy: jax.Array | None):
  """One pass over h = [value | gate]: the output and, given dy, the input gradient."""
  value, gate = jnp.split(h, 2, axis=-1)                       # (..., H) each
  act, dact = jax.vjp(_gate_fn(kind), gate.astype(jnp.float32))
  y = (value.astype(jnp.float32) * act).astype(h.dtype)        # (..., H)
  if dy is None:
    return y, None
  dy32 = dy.astype(jnp.float32)
  dvalue = dy32 * act
  (dgate,) = dact(dy32 * value.astype(jnp.float32))
  return y, jnp.concatenate([dvalue, dgate], axis=-1).astype(h.dtype)  # (..., 2H)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated_act(kind: str, h: jax.Array) -> jax.Array:
  """value * act(gate) for h = [value | gate]; kind in GATED."""
  return _gated_fwd_bwd(kind, h, None)[0]


def _gated_act_fwd(kind, h):
  return gated_act(kind, h), h   # save only the input: the backward recomputes act(gate)


def _gated_act_bwd(kind, h, dy):
  return (_gated_fwd_bwd(kind, h, dy)[1],)


gated_act.defvjp(_gated_act_fwd, _gated_act_bwd)


def gated_pair(kind: str, value: jax.Array, gate: jax.Array) -> jax.Array:
  """value * act(gate) (kind in GATED) from two separate matmul outputs (the Llama-style
  FFN's up and gate matrices), computed in float32 like `gated_act`; autodiff backward."""
  act = _gate_fn(kind)(gate.astype(jnp.float32))
  return (value.astype(jnp.float32) * act).astype(value.dtype)


def apply(name: str, h: jax.Array) -> jax.Array:
  if name in GATED:
    return gated_act(name, h)
  if name == "gelu":
    return jax.nn.gelu(h, approximate=True)
  if name == "relu":
    return jax.nn.relu(h)
  if name == "relu2":
    return relu2(h)
  raise ValueError(f"unknown activation {name!r}; valid: gelu, relu, relu2, {', '.join(GATED)}")
