"""Choosing SR-STE's masked-decay factor lambda_W automatically during warm-up.

Why: too little masked decay and pruned weights hover at the 2:4 threshold and keep
swapping with kept ones (the flip rate explodes, training is unstable); too much and pruned
weights collapse to zero and never come back (the flip rate drops to ~0: the mask freezes
early and the network stops exploring). Hu et al. 2024 pick a feasible lambda_W during
warm-up; their procedure is not available, so this one is designed from that goal.

Procedure (a multiplicative controller with a dead band, then frozen):

  state: lambda (starts at sparsity.decay_auto_init), r_ema (smoothed flip rate), count
  N = sparsity.decay_auto_steps (default: the lr warm-up)
  for every optimizer step N/2 <= s < N that measured a global flip rate r (per-step units;
  `train.train_step` gives NaN when there is no measurement, e.g. between two refreshes of
  a cached transposable mask):
    r_ema <- r on the first measurement, else EMA * r_ema + (1 - EMA) * r
    r_ema > target * band  ->  lambda <- min(lambda * rate, MAX_DECAY)   (flips too often)
    r_ema < target / band  ->  lambda <- max(lambda / rate, MIN_DECAY)   (mask freezing)
    otherwise              ->  lambda unchanged
  from step N on, nothing changes: lambda is frozen for the rest of training.

Only the second half of the window adapts: early in warm-up the learning rate is near zero
(exactly 0 at step 0), so the flip rate is small whatever lambda is, and a controller
listening then would shrink lambda for no reason (by up to rate^(N/2)) and spend the rest of
warm-up climbing back. In the second half the lr is at least half its peak.

Multiplicative steps because lambda_W spans orders of magnitude across model sizes
(6e-5 .. 2e-4 in the paper, much larger for tiny CPU models with large gradients); the dead
band stops the controller from chattering around the target; the EMA averages the
batch-to-batch noise of the per-step flip rate. Adapting only in warm-up and freezing
afterwards keeps the rest of training a fixed-hyper-parameter run (as in the paper) and lets
the flip rate decay naturally with the learning rate afterwards, which a controller that
kept chasing a fixed target would prevent.

Where it lives: the controller state is the top-level entry `KEY` of the train state's
'sparsity' collection (it has no 'mask', so it is not mistaken for a layer), so it is
checkpointed and a resumed run continues with the same lambda. The optimizer reads lambda
from there (`optim.add_masked_decay`'s `decay` extra argument).

When it acts: `enabled(cfg)` = sparsity.decay_auto and sparsity.decay == 0 and the projection
takes masked decay (sr_ste, t_sr_ste). A fixed sparsity.decay > 0 always wins.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from s24jax import projections

KEY = "decay_control"     # top-level entry of the 'sparsity' collection
EMA = 0.8                 # smoothing of the measured flip rate (per measurement)
MIN_DECAY = 1e-8          # lambda never leaves [MIN_DECAY, MAX_DECAY]
MAX_DECAY = 1.0


def enabled(cfg) -> bool:
  """Whether lambda_W is chosen automatically under the SparsityConfig `cfg`."""
  return bool(cfg.decay_auto and cfg.decay == 0
              and projections.get_projection(cfg.projection).masked_decay)


def init_state(cfg) -> dict[str, jax.Array]:
  """The controller's initial state: lambda = decay_auto_init, no measurement yet."""
  return {"decay": jnp.asarray(cfg.decay_auto_init, jnp.float32),
          "flip_ema": jnp.asarray(0.0, jnp.float32),
          "count": jnp.asarray(0, jnp.int32)}


def update(ctrl: dict[str, jax.Array], flip_rate: jax.Array, step: jax.Array,
           cfg) -> dict[str, jax.Array]:
  """One controller step after the optimizer step `step` (0-based) measured `flip_rate`.

  `flip_rate` is the global per-step flip rate, NaN when this step measured none. Acts only
  while N // 2 <= step < N (N = cfg.decay_auto_steps); returns the state unchanged otherwise.
  """
  r = jnp.asarray(flip_rate, jnp.float32)
  n = cfg.decay_auto_steps
  active = (step >= n // 2) & (step < n) & ~jnp.isnan(r)
  ema = jnp.where(ctrl["count"] == 0, r, EMA * ctrl["flip_ema"] + (1 - EMA) * r)
  lam = ctrl["decay"]
  hi, lo = cfg.decay_auto_target * cfg.decay_auto_band, cfg.decay_auto_target / cfg.decay_auto_band
  new_lam = jnp.where(ema > hi, jnp.minimum(lam * cfg.decay_auto_rate, MAX_DECAY),
                      jnp.where(ema < lo, jnp.maximum(lam / cfg.decay_auto_rate, MIN_DECAY), lam))
  return {"decay": jnp.where(active, new_lam, lam).astype(jnp.float32),
          "flip_ema": jnp.where(active, ema, ctrl["flip_ema"]).astype(jnp.float32),
          "count": ctrl["count"] + active.astype(jnp.int32)}


def current_decay(sparsity: Any, cfg) -> jax.Array | float:
  """The lambda_W the optimizer should use now: the controller's, else sparsity.decay."""
  if enabled(cfg) and sparsity and KEY in sparsity:
    return sparsity[KEY]["decay"]
  return cfg.decay
