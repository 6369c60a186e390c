"""Measurement chores of the loop: what optional features cost and do, logged with the run.

- Activation statistics (`act_sparsity.stats_sequences` > 0): the exact-zero share of the FFN
  activations and the L1 share a V:N:M mask keeps (s24jax/act_sparsity.py).
- MVUE's cost (`sparsity.mvue`): MVUE exists to make the weight-gradient GEMM 2:4 sparse, but
  only a sparse dW GEMM turns that into speed (docs/kernels.md); otherwise it adds an
  estimator and its noise. Once, at the first log step, the forward/backward of the step's
  batch is timed with MVUE on and off (the same model and state, compiled once each, the
  median of five interleaved repetitions): `perf/mvue_seconds` (the difference per step) and
  `perf/mvue_time_share` (that difference over the forward/backward time with MVUE on).
  Not charged to tokens/s.
"""
from __future__ import annotations

import dataclasses
import time

import jax

from s24jax import act_sparsity
from s24jax import chores as chores_lib
from s24jax import model as model_lib
from s24jax import train

MVUE_REPEATS = 5


def chores(config) -> list[chores_lib.Chore]:
  return [*act_sparsity.stats_chores(config), *mvue_cost_chores(config)]


def mvue_cost_chores(config) -> list[chores_lib.Chore]:
  if not config.sparsity.mvue:
    return []

  def measure(run):
    if not run.model_cfg.sparsity.method.sparse:
      return
    fn = jax.jit(train.loss_and_grads, static_argnames=("model", "accum_steps"))
    args = (run.state.params, run.state.sparsity, run.batch, jax.random.key(0))
    models = {mvue: model_lib.build(dataclasses.replace(
        run.model_cfg, sparsity=dataclasses.replace(run.model_cfg.sparsity, mvue=mvue)))
              for mvue in (True, False)}
    accum = int(config.grad_accum_steps)
    for model in models.values():   # compile both first
      jax.block_until_ready(fn(*args, model=model, accum_steps=accum))
    times = {True: [], False: []}
    for _ in range(MVUE_REPEATS):   # interleaved, so a load change hits both alike
      for mvue, model in models.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(*args, model=model, accum_steps=accum))
        times[mvue].append(time.perf_counter() - start)
    seconds = {mvue: sorted(t)[len(t) // 2] for mvue, t in times.items()}   # medians
    extra = seconds[True] - seconds[False]
    run.write(run.info.next_step, {"perf/mvue_seconds": extra,
                                   "perf/mvue_time_share": extra / seconds[True]})

  # After the first logged step.
  return [chores_lib.Chore(measure, due=lambda info: info.next_step == int(config.log_every),
                           name="MVUE cost")]
