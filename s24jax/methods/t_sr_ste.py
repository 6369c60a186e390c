"""t_sr_ste: Hu et al. 2024's 2:4 weights, a transposable mask cached between refreshes,
straight-through with masked decay (docs/algorithms.md, "Transposable 2:4 mask" and
"Hu et al. 2024"). With the three-GEMM op (`sparsity.mvue`) and dense fine-tuning
(`sparsity.dense_finetune_fraction`) it is the paper's fully sparse recipe.

The forward uses the cached mask layer['mask']; it is recomputed from W (transposable, so W~
is 2:4 along `out` too and the data-gradient GEMM dX = dY W~ is 2:4) only after every
`mask_refresh_every`-th optimizer step. Everything else (masked decay, the lambda_W
controller, the flip-rate warning) is SR-STE's (methods/sr_ste.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from s24jax import masks
from s24jax import state as state_lib
from s24jax.methods import base
from s24jax.methods import sr_ste


@jax.custom_vjp
def masked_ste24(w: jax.Array, mask: jax.Array, decay: jax.Array) -> jax.Array:
  """Forward W~ = mask * W with a given (cached) 2:4 mask; backward STE + masked decay:
  dL/dW := dL/dW~ + decay * (1 - mask) * W (`decay` is 0 unless the placement is
  'backward'). The mask is a bool input and `decay` a hyper-parameter: no cotangents."""
  return jnp.where(mask, w, 0)


def _masked_ste24_fwd(w, mask, decay):
  return masked_ste24(w, mask, decay), (w, mask, decay)


def _masked_ste24_bwd(res, g):
  w, mask, decay = res
  return g + (decay * jnp.where(mask, 0, w)).astype(g.dtype), None, jnp.zeros_like(decay)


masked_ste24.defvjp(_masked_ste24_fwd, _masked_ste24_bwd)


@dataclasses.dataclass(frozen=True)
class TSRSTE(sr_ste.SRSTE):
  # Optimizer steps between refreshes of the cached transposable mask (Hu et al.: 40).
  mask_refresh_every: int = 40

  def __post_init__(self):
    super().__post_init__()
    base.check_positive_int(f"sparsity.{self.name}.mask_refresh_every", self.mask_refresh_every)

  def mask(self, kernel, layer):
    del layer
    return masks.transposable_mask(kernel)

  def project(self, kernel, layer):
    return masked_ste24(kernel, layer["mask"], self.backward_decay())

  def next_masks(self, params, sparsity, step):
    """Fresh transposable masks after every k-th step (k = mask_refresh_every), else the
    cached ones. The flip rate is reported at refreshes as changed / k (the mean per-step
    rate over the interval) and NaN in between (no measurement); `transposable_kept_ratio`
    is the mean over layers of masks.transposable_kept_ratio at refreshes. Under jit only
    the taken branch runs: no mask work between refreshes."""
    k = self.mask_refresh_every
    refresh = (step + 1) % k == 0
    paths = state_lib.sparse_layer_paths(sparsity)

    def fresh():
      new = {p: self.mask(base.kernel_at(params, p), {}) for p in paths}
      kept = jnp.mean(jnp.stack([masks.transposable_kept_ratio(base.kernel_at(params, p))
                                 for p in paths]))
      return new, kept.astype(jnp.float32)

    def cached():
      return {p: base.layer_at(sparsity, p)["mask"] for p in paths}, jnp.float32(jnp.nan)

    new, kept = jax.lax.cond(refresh, fresh, cached)
    metrics = {name: jnp.where(refresh, rate / k, jnp.nan)
               for name, rate in base.flip_rates(new, sparsity).items()}
    metrics["transposable_kept_ratio"] = kept
    return new, metrics


base.register_method("t_sr_ste", TSRSTE())
