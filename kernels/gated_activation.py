"""Fused GEGLU / SwiGLU: [T, 2H] -> [T, H], forward and backward.

Why: a gated FFN computes act(gate) * value from the two halves of one
[T, 2H] projection. XLA typically reads the input once per op of the
activation and keeps f32 intermediates; the fused kernel reads each
(gate, value) pair once, computes in f32 and writes [T, H]. The backward
reads x and dY once and writes both halves of dX in the same program, so it
is one read of 3 x [T, H] and one write of [T, 2H].

Convention (the project's, `s24jax.nn.activations.gated_act`, so the kernel is
a drop-in for it): the *first* half of the last axis is the value, the second
half is the gate (goes through the activation):
    value, gate = x[..., :H], x[..., H:]
    geglu(x)  = value * gelu(gate)      (gelu: tanh approximation by default,
                                         GPT-2's; approximate=False -> erf)
    swiglu(x) = value * silu(gate)
Backward: dvalue = dy * act(gate), dgate = dy * value * act'(gate); dX is
[dvalue, dgate] concatenated along the last axis.

Tiles: x is viewed as [T, 2, H] (a free reshape) so one BlockSpec brings both
halves of a [BT, BH] tile into the same program.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from . import _common as c
from . import bench_harness

ACTIVATIONS = ("geglu", "swiglu")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


@dataclasses.dataclass(frozen=True)
class GatedActConfig(c.BlockConfig):
  """A [block_t, block_h] tile of each half per program (powers of two)."""
  block_t: int = 32
  block_h: int = 256


# Rational approximation of erf on [-4, 4] (the one Eigen / XLA use for f32,
# max error ~1e-7): the Pallas Triton backend has no erf primitive.
_ERF_ALPHA = (-2.72614225801306e-10, 2.77068142495902e-08,
              -2.10102402082508e-06, -5.69250639462346e-05,
              -7.34990630326855e-04, -2.95459980854025e-03,
              -1.60960333262415e-02)
_ERF_BETA = (-1.45660718464996e-05, -2.13374055278905e-04,
             -1.68282697438203e-03, -7.37332916720468e-03,
             -1.42647390514189e-02)


def _erf_f32(x):
  x = jnp.clip(x, -4.0, 4.0)
  x2 = x * x
  p = jnp.full_like(x, _ERF_ALPHA[0])
  for a in _ERF_ALPHA[1:]:
    p = p * x2 + a
  q = jnp.full_like(x, _ERF_BETA[0])
  for b in _ERF_BETA[1:]:
    q = q * x2 + b
  return x * p / q


def _act_and_grad(g, kind: str, approximate: bool):
  """act(g) and act'(g) in f32 (g is f32)."""
  if kind == "swiglu":
    s = 1.0 / (1.0 + jnp.exp(-g))
    return g * s, s * (1.0 + g * (1.0 - s))
  if approximate:
    u = _SQRT_2_OVER_PI * (g + _GELU_C * g * g * g)
    t = jnp.tanh(u)
    act = 0.5 * g * (1.0 + t)
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * g * g)
    return act, 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * du
  cdf = 0.5 * (1.0 + _erf_f32(g * (1.0 / math.sqrt(2.0))))
  pdf = jnp.exp(-0.5 * g * g) * (1.0 / math.sqrt(2.0 * math.pi))
  return g * cdf, cdf + g * pdf


def _fwd_kernel(x_ref, y_ref, *, kind, approximate):
  v = x_ref[:, 0, :].astype(jnp.float32)
  g = x_ref[:, 1, :].astype(jnp.float32)
  act, _ = _act_and_grad(g, kind, approximate)
  y_ref[...] = (act * v).astype(y_ref.dtype)


def _bwd_kernel(x_ref, dy_ref, dx_ref, *, kind, approximate):
  v = x_ref[:, 0, :].astype(jnp.float32)
  g = x_ref[:, 1, :].astype(jnp.float32)
  dy = dy_ref[...].astype(jnp.float32)
  act, dact = _act_and_grad(g, kind, approximate)
  dx_ref[:, 0, :] = (dy * act).astype(dx_ref.dtype)
  dx_ref[:, 1, :] = (dy * v * dact).astype(dx_ref.dtype)


def _tiles(t, h, config):
  bh, _ = c.fit_block(h, config.block_h)  # minimum 1: always divides h
  bt, tp = c.fit_block(t, config.block_t, minimum=min(config.block_t, 8))
  return bt, tp, bh


def _forward(x3, kind, approximate, config, interpret, poison):
  t, _, h = x3.shape
  bt, tp, bh = _tiles(t, h, config)
  x3 = c.pad_axis(x3, 0, tp)
  (y,) = c.pallas_call(
      functools.partial(_fwd_kernel, kind=kind, approximate=approximate),
      out_shape=[jax.ShapeDtypeStruct((tp, h), x3.dtype)],
      grid=(tp // bt, h // bh),
      in_specs=[pl.BlockSpec((bt, 2, bh), lambda i, j: (i, 0, j))],
      out_specs=[pl.BlockSpec((bt, bh), lambda i, j: (i, j))],
      num_warps=config.num_warps, num_stages=config.num_stages,
      interpret=interpret, poison=poison, name=f"{kind}_fwd",
  )(x3)
  return y[:t]


def _backward(x3, dy, kind, approximate, config, interpret, poison):
  t, _, h = x3.shape
  bt, tp, bh = _tiles(t, h, config)
  x3 = c.pad_axis(x3, 0, tp)
  dy = c.pad_axis(dy.astype(x3.dtype), 0, tp)
  (dx,) = c.pallas_call(
      functools.partial(_bwd_kernel, kind=kind, approximate=approximate),
      out_shape=[jax.ShapeDtypeStruct((tp, 2, h), x3.dtype)],
      grid=(tp // bt, h // bh),
      in_specs=[pl.BlockSpec((bt, 2, bh), lambda i, j: (i, 0, j)),
                pl.BlockSpec((bt, bh), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((bt, 2, bh), lambda i, j: (i, 0, j))],
      num_warps=config.num_warps, num_stages=config.num_stages,
      interpret=interpret, poison=poison, name=f"{kind}_bwd",
  )(x3, dy)
  return dx[:t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gated3(x3, kind, approximate, config, interpret, poison):
  return _forward(x3, kind, approximate, config, interpret, poison)


def _gated3_fwd(x3, kind, approximate, config, interpret, poison):
  return _forward(x3, kind, approximate, config, interpret, poison), x3


def _gated3_bwd(kind, approximate, config, interpret, poison, x3, dy):
  return (_backward(x3, dy, kind, approximate, config, interpret, poison),)


_gated3.defvjp(_gated3_fwd, _gated3_bwd)


@functools.partial(jax.jit, static_argnames=("kind", "approximate", "config",
                                             "interpret", "poison"))
def _gated_act(x, *, kind, approximate, config, interpret, poison=False):
  lead, two_h = x.shape[:-1], x.shape[-1]
  h = two_h // 2
  t = int(np.prod(lead)) if lead else 1
  y = _gated3(x.reshape(t, 2, h), kind, approximate, config, interpret,
              poison)
  return y.reshape(*lead, h)


def gated_act(x: jax.Array, kind: str = "geglu", *, approximate: bool = True,
              interpret: bool = False,
              config: GatedActConfig | None = None) -> jax.Array:
  """Fused gated activation: x [..., 2H] -> x[..., :H] * act(x[..., H:]).

  kind: "geglu" (gelu; tanh approximation unless approximate=False) or
  "swiglu" (silu). Differentiable (custom_vjp, fused backward kernel);
  math in f32, output in x's dtype.
  """
  if kind not in ACTIVATIONS:
    raise ValueError(f"unknown gated activation {kind!r}; valid: "
                     f"{ACTIVATIONS}.")
  if x.ndim < 1 or x.shape[-1] % 2:
    raise ValueError(f"the last dimension of x must be even (2H); got shape "
                     f"{x.shape}.")
  return _gated_act(x, kind=kind, approximate=bool(approximate),
                    config=config or GatedActConfig(), interpret=interpret)


def geglu(x, *, approximate=True, interpret=False, config=None):
  return gated_act(x, "geglu", approximate=approximate, interpret=interpret,
                   config=config)


def swiglu(x, *, interpret=False, config=None):
  return gated_act(x, "swiglu", interpret=interpret, config=config)


def gated_act_reference(x, kind: str = "geglu", *, approximate: bool = True):
  """Plain jnp (jax.nn) reference; differentiate it with jax.grad."""
  h = x.shape[-1] // 2
  v = x[..., :h].astype(jnp.float32)
  g = x[..., h:].astype(jnp.float32)
  act = (jax.nn.silu(g) if kind == "swiglu"
         else jax.nn.gelu(g, approximate=approximate))
  return (v * act).astype(x.dtype)


# ----------------------------------------------------------------------------
# Benchmark rows (python -m s24jax.kernels.bench; kernels/bench_harness.py).
# ----------------------------------------------------------------------------
def _bench_gated(shapes, dtype, interpret, reps):
  for t, d in shapes:
    h = 4 * d
    x = jax.random.normal(jax.random.key(0), (t, 2 * h), dtype)
    dy = jax.random.normal(jax.random.key(1), (t, h), dtype)
    isz = x.dtype.itemsize
    for kind in ACTIVATIONS:
      fast = jax.jit(functools.partial(gated_act, kind=kind, interpret=interpret))
      ref = jax.jit(functools.partial(gated_act_reference, kind=kind))
      yield bench_harness.row(f"{kind}_fwd", (t, 2 * h), bench_harness.time_fn(fast, x, reps=reps),
                       bench_harness.time_fn(ref, x, reps=reps), nbytes=3 * t * h * isz)
      fb = jax.jit(lambda x, dy, f=fast: jax.vjp(f, x)[1](dy)[0])
      rb = jax.jit(lambda x, dy, f=ref: jax.vjp(f, x)[1](dy)[0])
      yield bench_harness.row(f"{kind}_bwd", (t, 2 * h), bench_harness.time_fn(fb, x, dy, reps=reps),
                       bench_harness.time_fn(rb, x, dy, reps=reps), nbytes=5 * t * h * isz)


BENCHMARKS = {"gated": _bench_gated}


if __name__ == "__main__":   # this family's rows of python -m s24jax.kernels.bench
  raise SystemExit(bench_harness.main(
      BENCHMARKS, prog="python -m s24jax.kernels.gated_activation",
      description="Benchmark the fused GEGLU / SwiGLU (forward, backward) against XLA."))
