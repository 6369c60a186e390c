"""Whether a run's train step fits the device's memory, known before step 1 and before anything
is written (the loop compiles the step anyway: here, once, and the loop runs this executable).

`compile_first_step` compiles the train step of the run's first model on abstract inputs (the
state's shapes and shardings, the first batch) and checks XLA's memory figure for it
(`compiled.memory_analysis()`: arguments + outputs - donated + temporaries, per device) against
what the device has: a GPU's allocator limit (`memory_stats()['bytes_limit']`), on a CPU the
memory the kernel reports available (/proc/meminfo MemAvailable), less HEADROOM. A step that
does not fit stops the run with `DoesNotFit` (exit code 6, errors.EXIT_DOES_NOT_FIT): one line
with what it needs, what there is, and the nearest setting that fits. That is the largest
micro-batch (sequences per device; `grad_accum_steps` raised to keep the global batch) whose
compiled step fits: predicted from this compile (the temporaries scale with the micro-batch)
and confirmed by compiling it (at most MAX_TRIES compiles); on a CPU also the `:small`
variant, the CPU test bed.

On a CPU the step's cost is said at start: its FLOPs (XLA's cost analysis of this executable)
over the throughput of a float32 matmul timed here, and the run's length at that rate.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from s24jax.training import checkpoint as ckpt_lib
from s24jax import errors
from s24jax.nn import model as model_lib
from s24jax.training import model_schedule
from s24jax.training import sharding
from s24jax.training import train
from s24jax.step_info import StepInfo

HEADROOM = 0.10     # of the device's memory, for what XLA's figure leaves out (CUDA context,
                    # library workspaces, the host's other processes on a CPU)
MAX_TRIES = 3       # compiles of candidate micro-batches before giving up on a suggestion
GIB = 2 ** 30


class DoesNotFit(errors.KnownError):
  """The train step compiles but needs more memory than the device has; nothing written."""
  exit_code = errors.EXIT_DOES_NOT_FIT


def device_capacity(dev) -> tuple[int, str]:
  """(bytes a step may use on `dev`, what that figure is), before HEADROOM."""
  if dev.platform != "cpu":
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
      return int(stats["bytes_limit"]), f"this {dev.device_kind}'s memory"
    return 0, ""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      info = dict(line.split(":", 1) for line in f if ":" in line)
    return int(info["MemAvailable"].split()[0]) * 1024, "the memory available on this machine"
  except (OSError, KeyError, ValueError):
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages) * int(os.sysconf("SC_PAGE_SIZE")), "the memory free on this machine"


def needed_bytes(compiled) -> int:
  """Per device: XLA's arguments + outputs - donated (aliased) + temporaries."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)


@dataclasses.dataclass
class FirstStep:
  """The compiled train step of the run's first model, for the loop to run."""
  model_cfg: Any
  compiled: Any
  needed: int


def _abstract_state(spec, partitioner):
  shardings = partitioner.state_shardings(spec.abstract_state)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      spec.abstract_state, shardings)


def _compile(spec, partitioner, model, tx, batch, accum: int):
  """The train step compiled for these shapes (nothing runs)."""
  info = StepInfo(step=0, log=True)
  return train.train_step.trace(
      _abstract_state(spec, partitioner), batch, info, model=model, tx=tx,
      accum_steps=accum, partitioner=partitioner).lower().compile()


def compile_first_step(config, spec, partitioner, model_cfg, model, tx, batch, *,
                       source: str = "", dev=None) -> FirstStep:
  """The first step compiled and checked (module docstring): DoesNotFit if it cannot run.
  `source`: the config file (FILE.py[:variant]), named in DoesNotFit's message."""
  dev = dev or jax.devices()[0]
  compiled = _compile(spec, partitioner, model, tx, batch, config.grad_accum_steps)
  needed = needed_bytes(compiled)
  capacity, what = device_capacity(dev)
  if capacity and needed > capacity * (1 - HEADROOM):
    message = _does_not_fit(config, spec, partitioner, model, tx, batch, needed, capacity,
                            what, dev, source)
    cost = cpu_cost(config, compiled) if dev.platform == "cpu" else None
    raise DoesNotFit(f"{message} ({cost}.)" if cost else message)
  if dev.platform == "cpu":
    say_cpu_cost(config, compiled)
  return FirstStep(model_cfg, compiled, needed)


def first_step(config, checked, workdir: str, *, source: str = "") -> FirstStep:
  """The train step of the model the run starts with (a resumed run: the model of its last
  step), compiled on the state's shapes and the batch's (global, split over the mesh's
  devices), checked against the device's memory (`compile_first_step`). Writes nothing."""
  spec = checked.spec
  step = ckpt_lib.newest_step_on_disk(workdir) or 0
  model_cfg = model_schedule.model_at(step - 1, spec.model_cfg, spec.facts) if step else spec.model_cfg
  partitioner = sharding.Partitioner(checked.mesh)
  tokens = jax.ShapeDtypeStruct((config.batch_size, config.model.seq_len), jnp.int32,
                                sharding=partitioner.batch)   # as loop.shard_batch makes it
  abstract = spec.abstract_state
  return compile_first_step(config, spec, partitioner, model_cfg, model_lib.build(model_cfg),
                            spec.tx(abstract.params, abstract.sparsity),
                            {"inputs": tokens, "targets": tokens}, source=source)


def _micro_batches(per_device: int) -> list[int]:
  """The micro-batches a per-device batch splits into evenly, largest first."""
  return [m for m in range(per_device, 0, -1) if per_device % m == 0]


def _does_not_fit(config, spec, partitioner, model, tx, batch, needed: int, capacity: int,
                  what: str, dev, source: str) -> str:
  budget = capacity * (1 - HEADROOM)
  devices = partitioner.mesh.size
  per_device = config.batch_size // devices
  micro = per_device // config.grad_accum_steps
  head = (f"the train step needs {needed / GIB:.1f} GiB per device and {what} is "
          f"{capacity / GIB:.1f} GiB ({budget / GIB:.1f} GiB usable, {HEADROOM:.0%} kept "
          f"free): it does not fit, and nothing was written.")
  suggestion = _smaller_micro_batch(config, spec, partitioner, model, tx, batch, needed,
                                    budget, per_device, micro)
  small = f"{source.partition(':')[0] or 'FILE.py'}:small"
  cpu = (f" On a CPU, the config's ':small' variant is the test bed (--config {small})."
         if dev.platform == "cpu" else "")
  return f"{head} {suggestion}{cpu}"


def _smaller_micro_batch(config, spec, partitioner, model, tx, batch, needed: int,
                         budget: float, per_device: int, micro: int) -> str:
  """The nearest setting that fits, from the temporaries' scaling, confirmed by compiling."""
  compiled = None
  candidates = [m for m in _micro_batches(per_device) if m < micro]
  fixed = _fixed_bytes(spec, partitioner)
  tries = 0
  for m in candidates:
    # Temporaries scale with the micro-batch; the state does not.
    if fixed + (needed - fixed) * m / micro > budget and m != candidates[-1]:
      continue
    tries += 1
    compiled = _compile(spec, partitioner, model, tx, batch, per_device // m)
    got = needed_bytes(compiled)
    if got <= budget:
      return (f"The nearest setting that fits: --config.grad_accum_steps="
              f"{per_device // m} (micro-batch {m} sequences per device, {got / GIB:.1f} "
              f"GiB; the global batch unchanged).")
    needed, micro = got, m
    if tries >= MAX_TRIES:
      break
  return ("No micro-batch fits on its own: the model's state alone is "
          f"{fixed / GIB:.1f} GiB per device; use more devices with config.mesh's fsdp "
          "axis (python -m s24jax.perf.plan searches it for a GPU), or a smaller model.")


def _fixed_bytes(spec, partitioner) -> int:
  """The state's bytes per device (the part of the step that no micro-batch shrinks)."""
  shardings = partitioner.state_shardings(spec.abstract_state)
  total = 0
  for a, s in zip(jax.tree.leaves(spec.abstract_state), jax.tree.leaves(shardings)):
    shard = s.shard_shape(a.shape) if hasattr(s, "shard_shape") else a.shape
    total += int(np.prod(shard)) * jnp.dtype(a.dtype).itemsize
  return total


def matmul_flops_per_second(n: int = 1024, repeats: int = 3) -> float:
  """float32 matmul throughput of this process's default device, timed here (~0.1 s)."""
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    t = time.perf_counter()
    f(a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * n ** 3 / best


def cpu_cost(config, compiled) -> str | None:
  """What a step costs on this CPU and how long the run would take at that rate, in words
  (None where XLA gives no FLOP count)."""
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float(cost.get("flops", 0.0))
  except Exception:  # pylint: disable=broad-except  (an estimate, never a reason to stop)
    return None
  if flops <= 0:
    return None
  rate = matmul_flops_per_second()
  seconds = flops / rate
  return (f"on this CPU a train step costs about {_duration(seconds)} ({flops / 1e9:.3g} "
          f"GFLOP at the {rate / 1e9:.3g} GFLOP/s of a float32 matmul timed here): "
          f"{config.total_steps} steps would take about "
          f"{_duration(seconds * config.total_steps)}")


def say_cpu_cost(config, compiled) -> None:
  """Logs `cpu_cost` at the start of a run on a CPU."""
  line = cpu_cost(config, compiled)
  if line:
    logging.info("%s", line)


def _duration(seconds: float) -> str:
  for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
    if seconds >= 2 * size:
      return f"{seconds / size:.1f} {unit}"
  return f"{seconds:.2g} s"
