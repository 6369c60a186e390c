"""s_ste: S-STE (Hu, Zhu, Chen 2024), a continuous soft threshold with a fixed per-tensor
scale, straight-through (docs/algorithms.md, "S-STE"). The recipe adds the MVUE weight
gradient and FP8 GEMMs, both options of the sparse linear op (`sparsity.mvue`,
`sparsity.fp8`) that compose with any 2:4 method.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from s24jax.kernels import masks
from s24jax import state as state_lib
from s24jax.methods import base


def s_ste_scale(w: jax.Array) -> jax.Array:
  """beta = <w, S(w)> / <S(w), S(w)>, the least-squares scale of S(w) towards w (float32
  scalar; 1.0 when S(w) is all zeros). Computed once at init, then frozen."""
  w32 = w.astype(jnp.float32)
  s = masks.soft_threshold24(w32)
  num = jnp.vdot(w32, s)
  den = jnp.vdot(s, s)
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 1.0)


@jax.custom_vjp
def s_ste24(w: jax.Array, scale: jax.Array) -> jax.Array:
  """Forward beta * S(w); straight-through backward dL/dW := dL/d(beta S(w)), not multiplied
  by beta or dS/dw. `scale` is frozen state: no cotangent."""
  return (scale * masks.soft_threshold24(w)).astype(w.dtype)


def _s_ste24_fwd(w, scale):
  return s_ste24(w, scale), scale


def _s_ste24_bwd(scale, g):
  return g, jnp.zeros_like(scale)


s_ste24.defvjp(_s_ste24_fwd, _s_ste24_bwd)


@dataclasses.dataclass(frozen=True)
class SSTE(base.Method):
  # Recompute beta every k optimizer steps (the paper's ablation: it grows); 0 = fixed at
  # init (the recipe).
  rescale_every: int = 0

  def __post_init__(self):
    base.check_positive_int(f"sparsity.{self.name or 's_ste'}.rescale_every (0 = fixed scale)",
                            self.rescale_every, minimum=0)

  def init_layer(self, kernel):
    return {"scale": s_ste_scale(kernel), **super().init_layer(kernel)}

  def project(self, kernel, layer):
    return s_ste24(kernel, layer["scale"])

  def update(self, before, after, grads, info):
    """The masks (base), then beta <- s_ste_scale(W) after every rescale_every-th step (so
    from W_k, W_2k, ...), unchanged otherwise; never when rescale_every = 0."""
    after, metrics = super().update(before, after, grads, info)
    k = self.rescale_every
    if not k:
      return after, metrics
    new = {}
    for path in state_lib.sparse_layer_paths(after.sparsity):
      old = base.layer_at(after.sparsity, path)["scale"]
      new[path] = jax.lax.cond(info.next_step % k == 0,
                               lambda w=base.kernel_at(after.params, path):
                               base.per_layer(s_ste_scale)(w),
                               lambda old=old: jnp.asarray(old, jnp.float32))
    return after.replace(sparsity=state_lib.with_layer_entry(after.sparsity, "scale", new)), metrics
