"""t_sr_ste: Hu et al. 2024's 2:4 weights, a transposable mask cached between refreshes,
straight-through with masked decay (docs/algorithms.md, "Transposable 2:4 mask" and
"Hu et al. 2024"). With the three-GEMM op (`sparsity.mvue`) and dense fine-tuning
(`sparsity.dense_finetune_fraction`) it is the paper's fully sparse recipe.

The forward uses the cached mask layer['mask']; it is recomputed from W (transposable, so W~
is 2:4 along `out` too and the data-gradient GEMM dX = dY W~ is 2:4) only after every
`mask_refresh_every`-th optimizer step, or (`mask_refresh_drift` > 0) as soon as the weights
moved enough. Two per-step flip rates of the latent W: `flip_rate`, of its plain 2:4 mask
(layer['plain_mask'] keeps the previous one; what the drift refresh and the flip-rate warning
read), and `flip_rate_transposable`, of its transposable mask (the paper's r_t of the mask this
method applies; what the lambda_W controller steers on). Everything else (masked decay, the
lambda_W controller, the flip-rate warning) is SR-STE's (methods/sr_ste.py).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from s24jax.kernels import masks
from s24jax import state as state_lib
from s24jax.methods import base
from s24jax.methods import sr_ste
from s24jax.methods import straight_through

# The per-step flip rate of the transposable mask of the latent W (`TSRSTE.extra_flip_rates`).
TRANSPOSABLE_RATE = "flip_rate_transposable"


@dataclasses.dataclass(frozen=True)
class TSRSTE(sr_ste.SRSTE):
  transposable: ClassVar[bool] = True
  steer_on: ClassVar[str] = TRANSPOSABLE_RATE
  # Optimizer steps between refreshes of the cached transposable mask (Hu et al.: 40).
  mask_refresh_every: int = 40
  # 0: refresh exactly every mask_refresh_every steps (the paper). > 0: also refresh after
  # any step at which the plain 2:4 mask of W differs from the one at the last refresh in
  # more than this fraction of entries: the cache follows the weights, however fast the
  # learning rate moves them (docs/algorithms.md, "Hu et al. 2024").
  mask_refresh_drift: float = 0.0

  def __post_init__(self):
    super().__post_init__()
    base.check_positive_int(f"sparsity.{self.name}.mask_refresh_every", self.mask_refresh_every)
    if not 0.0 <= self.mask_refresh_drift < 1.0:
      raise ValueError(f"sparsity.{self.name}.mask_refresh_drift must be in [0, 1), got "
                       f"{self.mask_refresh_drift}")

  def init_layer(self, kernel):
    plain = masks.nm_mask(kernel)
    layer = {"mask": self.mask(kernel, {}), "plain_mask": plain}
    if self.mask_refresh_drift:
      layer["refresh_mask"] = jnp.array(plain, copy=True)   # its own buffer (donation)
    return layer

  def mask(self, kernel, layer):
    del layer
    return masks.transposable_mask(kernel)

  def project(self, kernel, layer):
    return straight_through.masked(kernel, layer["mask"], self.backward_decay())

  def extra_flip_rates(self, before, after, info):
    """`flip_rate_transposable` (per layer and global): transposable_mask(W_t) against
    transposable_mask(W_{t-1}), from the params before and after the step, so no mask is
    kept in the state. Two transposable masks per layer cost ~17% of a `small` CPU step
    (docs/algorithms.md, "Flip rate"), so they are computed only where the rate is read: at
    the steps the loop logs, and in the lambda_W controller's window; NaN at the others (the
    log's mean skips NaN: the logged value is then the log step's own rate)."""
    paths = state_lib.sparse_layer_paths(after.sparsity)

    def measure():
      new = {p: masks.transposable_mask(base.kernel_at(after.params, p)) for p in paths}
      old = {p: masks.transposable_mask(base.kernel_at(before.params, p)) for p in paths}
      return base.flip_rates_between(new, old, name=TRANSPOSABLE_RATE)

    def skip():
      return jax.tree.map(lambda x: jnp.full(x.shape, jnp.nan, x.dtype), jax.eval_shape(measure))

    due = info.log
    if self.controlled:
      due = due | self.in_controller_window(info.step)
    return jax.lax.cond(due, measure, skip)

  def refresh(self, params, sparsity, info):
    """Every step: the plain 2:4 mask of the updated W, its flip rate against the previous
    step's (`flip_rate`; the transposable mask's is `extra_flip_rates`'). At a
    refresh (after every k-th step, k = mask_refresh_every, or when the plain mask drifted
    more than mask_refresh_drift since the last refresh): fresh transposable masks for the
    forward, `mask_refresh/changed` (the fraction of the cached mask that changed: the
    refresh-interval change) and `transposable_kept_ratio` (mean over layers); NaN between
    refreshes. `mask_refresh/refreshed` is 1 at a refresh (its log mean: the refresh rate).
    Under jit only the taken branch runs: no transposable-mask work between refreshes."""
    paths = state_lib.sparse_layer_paths(sparsity)
    kernels = {p: base.kernel_at(params, p) for p in paths}
    plain = {p: masks.nm_mask(w) for p, w in kernels.items()}
    metrics = base.flip_rates(plain, sparsity, entry="plain_mask")
    sparsity = state_lib.with_layer_entry(sparsity, "plain_mask", plain)
    refresh = jnp.asarray(info.next_step % self.mask_refresh_every == 0)
    if self.mask_refresh_drift:
      drift = base.flip_rates(plain, sparsity, entry="refresh_mask", name="drift")["drift"]
      metrics["mask_refresh/drift"] = drift
      refresh = refresh | (drift > self.mask_refresh_drift)

    def fresh():
      new = {p: self.mask(w, {}) for p, w in kernels.items()}
      kept = jnp.mean(jnp.stack([masks.transposable_kept_ratio(w) for w in kernels.values()]))
      return new, kept.astype(jnp.float32)

    def cached():
      return {p: base.layer_at(sparsity, p)["mask"] for p in paths}, jnp.float32(jnp.nan)

    new, kept = jax.lax.cond(refresh, fresh, cached)
    changed = base.flip_rates(new, sparsity, name="changed")["changed"]
    metrics.update({"mask_refresh/changed": jnp.where(refresh, changed, jnp.nan),
                    "mask_refresh/refreshed": refresh.astype(jnp.float32),
                    "transposable_kept_ratio": kept})
    sparsity = state_lib.with_masks(sparsity, new)
    if self.mask_refresh_drift:
      sparsity = state_lib.with_layer_entry(
          sparsity, "refresh_mask",
          {p: jnp.where(refresh, plain[p], base.layer_at(sparsity, p)["refresh_mask"])
           for p in paths})
    return sparsity, metrics
