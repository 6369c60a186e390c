"""Measurement chores of the loop: what optional features cost and do, logged with the run.

- Activation statistics (`act_sparsity.stats_sequences` > 0): the exact-zero share of the FFN
  activations and the L1 share a V:N:M mask keeps (s24jax/nn/act_sparsity.py).
- MVUE's cost (`sparsity.mvue`): MVUE exists to make the weight-gradient GEMM 2:4 sparse, but
  only a sparse dW GEMM turns that into speed (docs/kernels.md); otherwise it adds an
  estimator and its noise. Once, at the first log step, the forward/backward of the step's
  batch (same model, state and batch) with MVUE on and with it off, each compiled once as n
  forward/backwards inside one jitted loop (kernels/timing.py `in_loop`; n sized so a loop
  takes about LOOP_SECONDS), timed in MVUE_PAIRS pairs, the order inside a pair alternating:
    `perf/mvue_seconds`          the median over the pairs of (on - off) per step;
    `perf/mvue_seconds_noise`    the distance from that median to the farther of the second
                                 smallest and the second largest difference: value +- noise
                                 holds the true median difference with probability at least
                                 1 - 2 (1 + pairs) / 2^pairs (a sign test, no assumption on
                                 the noise's distribution; 96 % for 9 pairs), one outlier
                                 pair at each end left out;
    `perf/mvue_time_share`, `perf/mvue_time_share_noise`: both over the on-step's time.
  Nothing is clamped. |value| <= noise means the cost is below what this measurement resolves
  (a cost too small to matter next to the run's own timing noise, as in a 1 ms step on a
  shared GPU). A value below -noise would mean the two programs differ in more than MVUE
  (XLA fused them differently): report it, do not hide it. Not charged to tokens/s.

Why not single dispatches, as before: on the H100 (2026-11-27, the 'small' recipe beside six
test processes) the median of five host wall-clock timings of single dispatches per variant
gave -8.5e-5 s (-3.3 % of a 2.6 ms forward/backward), with nothing to say how large the
timing noise was; most likely it was noise (not re-measured on a GPU since).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Any, Callable, Sequence

from flax import traverse_util
import jax
import jax.numpy as jnp

from s24jax.nn import act_sparsity
from s24jax import chores as chores_lib
from s24jax.nn import model as model_lib
from s24jax.training import train
from s24jax.kernels import timing

MVUE_PAIRS = 9
LOOP_SECONDS = 0.05      # one timed loop: long enough to dwarf its launch, short for a chore
MAX_LOOP_CALLS = 1000


@dataclasses.dataclass(frozen=True)
class PairedCost:
  """What `on` costs over `off`, per call (module docstring): `seconds` +- `noise`."""
  seconds: float
  noise: float
  on_seconds: float       # the median time per call of `on`
  calls: int              # calls per timed loop
  pairs: int

  @property
  def resolved(self) -> bool:
    """Whether the cost is told apart from zero (|seconds| > noise)."""
    return abs(self.seconds) > self.noise


def paired_cost(on: Callable, off: Callable, args: Sequence[Any], *, pairs: int = MVUE_PAIRS,
                loop_seconds: float = LOOP_SECONDS,
                max_calls: int = MAX_LOOP_CALLS) -> PairedCost:
  """The cost of on(*args) over off(*args), each run n times in one jitted loop (module
  docstring; pairs >= 3)."""
  if pairs < 3:
    raise ValueError(f"paired_cost needs at least 3 pairs, got {pairs}")
  runs = {name: jax.jit(timing.in_loop(fn)) for name, fn in (("on", on), ("off", off))}

  def seconds(name: str, n: int) -> float:
    start = time.perf_counter()
    jax.block_until_ready(runs[name](n, *args))
    return time.perf_counter() - start

  for name in runs:                  # compile both (n is traced: one program for every n)
    seconds(name, 1)
  once = min(seconds("on", 1), seconds("off", 1))
  n = int(min(max_calls, max(1, math.ceil(loop_seconds / max(once, 1e-9)))))
  diffs, on_times = [], []
  for i in range(pairs):
    order = ("on", "off") if i % 2 == 0 else ("off", "on")   # a drift hits both alike
    t = {name: seconds(name, n) / n for name in order}
    diffs.append(t["on"] - t["off"])
    on_times.append(t["on"])
  median = statistics.median(diffs)
  low, high = sorted(diffs)[1], sorted(diffs)[-2]      # an outlier pair at each end left out
  return PairedCost(seconds=median, noise=max(median - low, high - median),
                    on_seconds=statistics.median(on_times), calls=n, pairs=pairs)


def chores(config) -> list[chores_lib.Chore]:
  return [*stats_chores(config), *mvue_cost_chores(config)]


def mvue_cost_chores(config) -> list[chores_lib.Chore]:
  if not config.sparsity.mvue:
    return []
  accum = int(config.grad_accum_steps)

  def measure(run):
    if not run.model_cfg.sparsity.method.sparse:
      return
    fns = {}
    for mvue in (True, False):
      model = model_lib.build(dataclasses.replace(
          run.model_cfg, sparsity=dataclasses.replace(run.model_cfg.sparsity, mvue=mvue)))
      fns[mvue] = lambda params, sparsity, batch, key, model=model: train.loss_and_grads(
          params, sparsity, batch, key, model=model, accum_steps=accum)
    args = (run.state.params, run.state.sparsity, run.batch, jax.random.key(0))
    cost = paired_cost(fns[True], fns[False], args)
    run.write(run.info.next_step, mvue_metrics(cost))

  # After the first logged step.
  return [chores_lib.Chore(measure, due=lambda info: info.next_step == int(config.log_every),
                           name="MVUE cost")]


def mvue_metrics(cost: PairedCost) -> dict[str, float]:
  return {"perf/mvue_seconds": cost.seconds, "perf/mvue_seconds_noise": cost.noise,
          "perf/mvue_time_share": cost.seconds / cost.on_seconds,
          "perf/mvue_time_share_noise": cost.noise / cost.on_seconds}


# ---------------------------------------------------------------------------------------------
# Activation statistics (V:N:M, Haziza et al.): measured on the step's batch.


@functools.partial(jax.jit, static_argnames=("model", "num_sequences"))
def activation_stats(params: Any, sparsity: Any, inputs: jax.Array, *, model: Any,
                     num_sequences: int = 0) -> dict[str, jax.Array]:
  """Per-layer activation statistics of one forward pass on inputs (B, T) (first
  `num_sequences` rows; 0: all). Keys 'act/<stat>/<layer>' plus the layer means 'act/<stat>'.
  """
  if num_sequences:
    inputs = inputs[:num_sequences]
  variables = {"params": params, "sparsity": sparsity} if sparsity else {"params": params}
  _, state = model.apply(variables, inputs, mutable=["intermediates"])
  return stats_from_intermediates(state.get("intermediates", {}))


def stats_from_intermediates(intermediates: Any) -> dict[str, jax.Array]:
  """Flattens sown {'h_0': {'mlp': {'act_zero_frac': (x,)}}} into 'act/zero_frac/h_0' etc."""
  flat = traverse_util.flatten_dict(dict(intermediates))
  out: dict[str, jax.Array] = {}
  per_stat: dict[str, list[jax.Array]] = {s: [] for s in act_sparsity.STATS}
  for path, value in sorted(flat.items()):
    name = path[-1]
    if not name.startswith("act_") or name[4:] not in act_sparsity.STATS:
      continue
    stat = name[4:]
    layer = path[0] if path[1:-1] == ("mlp",) else "/".join(path[:-1])
    x = value[-1] if isinstance(value, tuple) else value
    if jnp.ndim(x) == 1:   # scanned blocks ('h'): one value per layer, stacked
      for i, xi in enumerate(x):
        out[f"act/{stat}/{layer}_{i}"] = xi
        per_stat[stat].append(xi)
      continue
    out[f"act/{stat}/{layer}"] = x
    per_stat[stat].append(x)
  for stat, xs in per_stat.items():
    if xs:
      out[f"act/{stat}"] = jnp.mean(jnp.stack(xs))
  return out


def stats_chores(config) -> list[chores_lib.Chore]:
  """The loop's measurement chore: before the train step of every logged step, one extra
  forward on the first `config.act_sparsity.stats_sequences` sequences of the step's batch
  (the activations this step trains on), logged with that step's log; its time is not
  training time."""
  n = int(config.act_sparsity.stats_sequences)
  if not n:
    return []

  def measure(run):
    stats = activation_stats(run.state.params, run.state.sparsity, run.batch["inputs"],
                             model=run.model, num_sequences=min(n, config.batch_size))
    run.write(run.info.next_step, {k: float(v) for k, v in jax.device_get(stats).items()})

  return [chores_lib.Chore(measure, before_step=True, due=lambda info: info.log,
                           name="activation statistics")]
