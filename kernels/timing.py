"""Timing on the device: a function's seconds per call, from calls made inside one jitted loop
(`in_loop`, `loop_seconds_each`, `loop_seconds`). The library times with it (the per-GEMM
choice's first-use measurement, the MVUE cost metric); the kernel benchmarks' tables and
command line are kernels/bench_harness.py.

This module imports no kernel file, so every kernel file may import it.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp


def in_loop(fn: Callable) -> Callable:
  """`run(n, *args)`: fn(*args) called n times inside one lax.fori_loop; returns the last
  call's output. Jit it (n static: a known trip count, which XLA:GPU runs without reading the
  loop condition back to the host each iteration; n traced: one compile for every n).

  XLA hoists loop-invariant work out of a loop (and drops optimization barriers before it
  does), so each call's arguments are made to vary: the first element of every floating
  array gets 0 x (the previous call's first output element) added (0 x a float is not folded:
  NaN rules; kept finite, so the values never change), in place, and each call's PRNG keys
  are the last call's folded with the iteration index; integer arrays stay as they are (work on them alone may be
  hoisted). The last output is the loop's result, so no call is dead code. Timing the loop
  and dividing by n leaves out the host's dispatch and synchronisation, which a single call
  of a 0.1 ms GEMM would mostly measure. The price: one tiny in-place update per floating
  argument per call (a small kernel on a GPU, a few microseconds; not measured here), the
  same for every function timed this way, so it cancels in a difference and slightly
  flattens a ratio of the shortest calls."""
  def run(n, *args):
    shapes = jax.eval_shape(fn, *args)
    prev = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def body(i, carry):
      args, prev = carry
      tie = _zero_tied_to(prev)
      args = jax.tree.map(lambda a: _vary(a, tie, i), args)
      return args, fn(*args)

    return jax.lax.fori_loop(0, n, body, (args, prev))[1]
  return run


def _zero_tied_to(tree) -> jax.Array:
  """A float32 zero that XLA must compute from `tree`'s first floating element."""
  floats = [l for l in jax.tree.leaves(tree)
            if jnp.issubdtype(l.dtype, jnp.floating) and l.size]
  if not floats:
    return jnp.zeros((), jnp.float32)
  first = floats[0].reshape(-1)[0].astype(jnp.float32)
  return jnp.where(jnp.isfinite(first), first, 0.0) * 0.0


def _vary(a, tie, i):
  if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
    return jax.random.fold_in(a, i) if a.ndim == 0 else a
  if jnp.issubdtype(a.dtype, jnp.floating) and a.size:
    first = (0,) * a.ndim
    return a.at[first].set((a[first].astype(jnp.float32) + tie).astype(a.dtype))
  return a


def loop_seconds_each(fn: Callable, *args, calls: int, repeats: int = 5) -> list[float]:
  """Seconds per call of fn(*args) in each of `repeats` timings (in their order) of `calls`
  calls inside one jitted loop (`in_loop`, `calls` static), after one warm-up (the compile)."""
  run = jax.jit(in_loop(fn), static_argnums=0)
  jax.block_until_ready(run(calls, *args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(run(calls, *args))
    times.append((time.perf_counter() - t0) / calls)
  return times


def loop_seconds(fn: Callable, *args, calls: int, repeats: int = 5) -> float:
  """Median seconds per call of fn(*args) over the `repeats` timings of `loop_seconds_each`."""
  return statistics.median(loop_seconds_each(fn, *args, calls=calls, repeats=repeats))
