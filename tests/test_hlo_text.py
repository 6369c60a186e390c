"""Tests for s24jax/hlo_text.py's `canonical` (its parsing is tested through
tests/test_step_census.py): the same program compiled from other source lines, names and
numbering compares equal; any change to what runs does not."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from s24jax import hlo_text


def _compiled(fn, *args) -> str:
  cpu = jax.devices("cpu")[0]
  return jax.jit(fn).lower(*jax.device_put(args, cpu)).compile().as_text()


def _first(x, w):
  return jnp.tanh(x @ w) * 2.0


def _second(x, w):    # the same program: other lines, other names
  y = x @ w
  return jnp.tanh(y) * 2.0


def test_the_same_program_from_other_source_compares_equal():
  x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
  a, b = _compiled(_first, x, w), _compiled(_second, x, w)
  assert a != b                       # metadata, stack frames, numbering differ
  assert "stack_frame_id" in a or "metadata" in a
  assert hlo_text.canonical(a.replace("jit__first", "m")) == hlo_text.canonical(
      b.replace("jit__second", "m"))


def test_another_program_compares_unequal():
  x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
  base = hlo_text.canonical(_compiled(_first, x, w))
  for other in (lambda x, w: jnp.tanh(x @ w) * 3.0,            # a constant
                lambda x, w: jax.nn.sigmoid(x @ w) * 2.0,      # an op
                lambda x, w: jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)) * 2.0):
    text = _compiled(other, x, w)
    assert hlo_text.canonical(text.replace("jit__lambda", "jit__first")) != base
