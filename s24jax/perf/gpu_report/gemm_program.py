"""One compiled program per GEMM row: every variant's timed loop behind a runtime index.

`build(variants)` jits `gemm_row(index, operands)`: a `lax.switch` on `index` (traced, so one
compile serves every variant) whose branch i calls variant i's function `calls` times in a
`fori_loop` (kernels/timing.py `in_loop`: each call's floating arguments tied to the last
call's output, so XLA can neither hoist nor overlap them) and returns the sum of the last
call's output. The sum makes XLA compute that output whole (a switch returns one type for
every branch, so the branches cannot return their outputs); it is one pass over the output
per loop, counted in the loop's time: on a GPU, at the smallest loops (gemm_plan.MIN_CALLS
calls of the largest GEMMs), about 1 % of a call, the same for a row's dense and 2:4 GEMMs.
A loop also copies the arguments it carries and zeroes its first "last output" once
(in_loop: XLA's loop carries cannot alias the program's inputs): per loop, not per call.

`seconds_per_call` compiles the program, runs it once per variant (the warm-up: cuSPARSELt
plans its GEMM at the first call), then `repeats` rounds of every variant in turn, each timed
on the host around one program call (its dispatch included: microseconds against a loop of
about gemm_plan.LOOP_SECONDS) and divided by its calls.

Runs on a CPU under the cuSPARSELt stand-in (the CPU suite checks the compile count there);
never run on a GPU.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from s24jax.perf.gpu_report import rows
from s24jax.kernels import timing

PROGRAM_NAME = "gemm_row"     # the jitted function's name (jax's compile logs show it)


@dataclasses.dataclass(frozen=True)
class Variant:
  """A function timed in the row's program: fn(*operands[a] for a in args), `calls` a loop."""
  name: str
  fn: Callable[..., Any]
  args: tuple[str, ...]
  calls: int


def _with_first_value(fn):
  """fn with a float32 scalar of its output's first element put first: in_loop ties the next
  call's arguments to the first floating output, which an integer output (a compressed
  buffer) does not have."""
  def wrapped(*args):
    out = fn(*args)
    first = jax.tree.leaves(out)[0]
    return first.reshape(-1)[0].astype(jnp.float32), out
  return wrapped


def _sum(tree) -> jax.Array:
  return sum((jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(tree)),
             jnp.zeros((), jnp.float32))


def build(variants: list[Variant]) -> Callable[[jax.Array, dict], jax.Array]:
  """The row's program, jitted: gemm_row(index, operands) -> float32 (module docstring)."""
  def branch(v: Variant):
    def run(operands):
      out = timing.in_loop(_with_first_value(v.fn))(v.calls, *(operands[a] for a in v.args))
      return _sum(out)
    return run

  def gemm_row(index, operands):
    return jax.lax.switch(index, [branch(v) for v in variants], operands)

  gemm_row.__name__ = gemm_row.__qualname__ = PROGRAM_NAME
  return jax.jit(gemm_row)


def seconds_per_call(program, operands: dict, variants: list[Variant], repeats: int
                     ) -> tuple[dict[str, list[float]], dict[str, str]]:
  """({variant: seconds per call in each of `repeats` rounds}, {variant: the error of one
  whose warm-up failed, left out of the rounds}) (module docstring). The program is compiled
  once, first (an error there is raised: no variant can run)."""
  compiled = program.lower(jnp.int32(0), operands).compile()
  ok, failed = [], {}
  for i, v in enumerate(variants):
    try:
      jax.block_until_ready(compiled(jnp.int32(i), operands))
      ok.append(i)
    except Exception as e:  # pylint: disable=broad-except  (one kernel's error: the rest run)
      failed[v.name] = rows.error_line(e)
  times = {variants[i].name: [] for i in ok}
  for _ in range(repeats):
    for i in ok:
      start = time.perf_counter()
      jax.block_until_ready(compiled(jnp.int32(i), operands))
      times[variants[i].name].append((time.perf_counter() - start) / variants[i].calls)
  return times, failed
