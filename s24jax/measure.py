"""Measurement hooks of the loop: what optional features cost and do, logged with the run.

- Activation statistics (`act_sparsity.stats_sequences` > 0): the exact-zero share of the FFN
  activations and the L1 share a V:N:M mask keeps (s24jax/act_sparsity.py).
- MVUE's cost (`sparsity.mvue`): MVUE exists to make the weight-gradient GEMM 2:4 sparse, but
  only a sparse dW GEMM turns that into speed (docs/kernels.md); otherwise it adds an
  estimator and its noise. Once, at the first log step, the forward/backward of the step's
  batch is timed with MVUE on and off (the same model and state, compiled once each, best of
  a few repetitions): `perf/mvue_seconds` (the difference per step) and
  `perf/mvue_time_share` (that difference over the forward/backward time with MVUE on).
  Not charged to tokens/s.
"""
from __future__ import annotations

import dataclasses
import time

import jax

from s24jax import act_sparsity
from s24jax import hooks as hooks_lib

MVUE_REPEATS = 3


def hooks(config) -> list[hooks_lib.Hook]:
  return [*act_sparsity.stats_hooks(config), *mvue_cost_hooks(config)]


def mvue_cost_hooks(config) -> list[hooks_lib.Hook]:
  if not config.sparsity.mvue:
    return []

  def measure(run):
    from s24jax import model as model_lib   # pylint: disable=g-import-not-at-top
    from s24jax import train   # pylint: disable=g-import-not-at-top
    if not run.model_cfg.sparsity.method.sparse:
      return
    seconds = {}
    for mvue in (True, False):
      cfg = dataclasses.replace(run.model_cfg,
                                sparsity=dataclasses.replace(run.model_cfg.sparsity, mvue=mvue))
      fn = jax.jit(train.loss_and_grads, static_argnames=("model", "accum_steps"))
      args = (run.state.params, run.state.sparsity, run.batch, jax.random.key(0))
      kwargs = {"model": model_lib.GPT2(cfg), "accum_steps": int(config.grad_accum_steps)}
      jax.block_until_ready(fn(*args, **kwargs))   # compile
      best = float("inf")
      for _ in range(MVUE_REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        best = min(best, time.perf_counter() - start)
      seconds[mvue] = best
    extra = seconds[True] - seconds[False]
    run.write(run.step, {"perf/mvue_seconds": extra,
                         "perf/mvue_time_share": extra / seconds[True]})

  return [hooks_lib.Hook(measure, due=lambda step: step == int(config.log_every),
                         name="MVUE cost")]
