"""Tests for s24jax/perf/hlo_text.py's `canonical` and `module_text` (its parsing is tested through
tests/perf/test_step_census.py): the same program compiled from other source lines, names and
numbering compares equal; any change to what runs does not, a constant's value included."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.perf import hlo_text


def _compiled(fn, *args):
  cpu = jax.devices("cpu")[0]
  return jax.jit(fn).lower(*jax.device_put(args, cpu)).compile()


def _text(fn, *args) -> str:
  return hlo_text.module_text(_compiled(fn, *args))


def _first(x, w):
  return jnp.tanh(x @ w) * 2.0


def _second(x, w):    # the same program: other lines, other names
  y = x @ w
  return jnp.tanh(y) * 2.0


def test_the_same_program_from_other_source_compares_equal():
  x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
  a, b = _text(_first, x, w), _text(_second, x, w)
  assert a != b                       # module names, metadata, stack frames, numbering differ
  assert "jit__first" in a and ("stack_frame_id" in a or "metadata" in a)
  assert hlo_text.canonical(a) == hlo_text.canonical(b)
  # module_text is as_text with the values of large constants (none here); XLA's two
  # printers order a backend config's keys differently
  assert hlo_text.canonical(a) == hlo_text.canonical(_compiled(_first, x, w).as_text())


def test_another_program_compares_unequal():
  x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
  base = hlo_text.canonical(_text(_first, x, w))
  for other in (lambda x, w: jnp.tanh(x @ w) * 3.0,            # a constant
                lambda x, w: jax.nn.sigmoid(x @ w) * 2.0,      # an op
                lambda x, w: jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)) * 2.0):
    assert hlo_text.canonical(_text(other, x, w)) != base


def _half(v):
  return v * 0.5


def _half_again(u):   # the same program: another name, another argument name
  return u * 0.5


def test_a_scalar_constant_keeps_its_value():
  x = jnp.ones((8, 16))
  half, quarter = _text(_half, x), _text(lambda v: v * 0.25, x)
  assert "constant(0.5)" in half and "constant(0.25)" in quarter
  assert hlo_text.canonical(half) != hlo_text.canonical(quarter)
  assert hlo_text.canonical(half) == hlo_text.canonical(_text(_half_again, x))


def test_a_large_constant_keeps_its_values():
  """A 64-element literal, which as_text prints as {...}: module_text prints its values and
  canonical keeps a digest of them; one value changed is another program. Text without the
  values is refused, not called equal."""
  x = jnp.ones((64,))
  k = np.linspace(0.0, 1.0, 64).astype(np.float32)
  k_other = k.copy()
  k_other[5] = 7.0
  same, other = _compiled(lambda v: v * k, x), _compiled(lambda v: v * k_other, x)
  assert "constant({...})" in same.as_text() and "constant({...})" in other.as_text()
  a, b = hlo_text.module_text(same), hlo_text.module_text(other)
  assert "{...}" not in a and "0.015873" in a and ", 7," in b
  assert hlo_text.canonical(a) != hlo_text.canonical(b)
  assert hlo_text.canonical(a) == hlo_text.canonical(_text(lambda u: u * k, x))
  assert len(hlo_text.canonical(a)) < len(a)            # the literal kept as a digest
  with pytest.raises(ValueError, match="module_text"):
    hlo_text.canonical(same.as_text())


def test_names_and_metadata_go_where_they_hold_brackets():
  """Hand-written: an op name with a brace and a parenthesis in its metadata, header
  parameters named differently; the constant and the ops stay."""
  def module(param, op_name, value):
    return (f"HloModule jit_{param}, is_scheduled=true\n\n"
            f"ENTRY %main.{len(param)} ({param}.1: f32[4]) -> f32[4] {{\n"
            f"  %{param}.1 = f32[4]{{0}} parameter(0), metadata={{op_name=\"{param}\"}}\n"
            f"  %c.2 = f32[] constant({value})\n"
            f"  %b.3 = f32[4]{{0}} broadcast(%c.2), dimensions={{}}\n"
            f"  ROOT %m.4 = f32[4]{{0}} multiply(%{param}.1, %b.3), "
            f"metadata={{op_name=\"{op_name}\" stack_frame_id=3}}\n}}\n")
  a = hlo_text.canonical(module("x", "jit(f)/mul{a}", 0.5))
  assert a == hlo_text.canonical(module("weights", "jit(g)/wrap(})/mul", 0.5))
  assert a != hlo_text.canonical(module("x", "jit(f)/mul{a}", 0.25))
  assert "metadata" not in a and "jit" not in a and "constant(0.5)" in a
