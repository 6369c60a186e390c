"""Tests for s24jax/step_info.py: `StepInfo.at` against a brute-force rule written here (a
step is logged when the steps done, its index + 1, are a multiple of log_every, or it is the
last step), `next_step`, and `StepInfo` through jax.jit as a pytree."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.step_info import StepInfo


def _logged_by_hand(log_every, total):
  """The 0-based indices of the logged steps, by enumeration."""
  out = []
  for step in range(total):
    done = step + 1
    if (log_every > 0 and done % log_every == 0) or done == total:
      out.append(step)
  return out


@pytest.mark.parametrize("log_every,total", [(1, 5), (3, 10), (5, 24), (4, 8), (7, 3),
                                             (10, 10), (0, 6), (2, 1)])
def test_log_is_the_brute_force_rule(log_every, total):
  infos = [StepInfo.at(step, log_every=log_every, total=total) for step in range(total)]
  assert [i.step for i in infos if i.log] == _logged_by_hand(log_every, total)
  for step, info in enumerate(infos):
    assert info.step == step and info.next_step == step + 1
    assert isinstance(info.log, bool)
  assert infos[-1].log                              # the last step is always logged


def test_examples_written_out():
  # log_every=3 over 10 steps: after steps 3, 6, 9 and the last, 10 (indices 2, 5, 8, 9)
  assert [s for s in range(10) if StepInfo.at(s, log_every=3, total=10).log] == [2, 5, 8, 9]
  assert StepInfo.at(0, log_every=1, total=4) == StepInfo(step=0, log=True)
  assert StepInfo.at(0, log_every=2, total=4) == StepInfo(step=0, log=False)


def test_step_info_passes_through_jit_as_a_pytree():
  info = StepInfo(step=jnp.asarray(6, jnp.int32), log=jnp.asarray(True))
  leaves, treedef = jax.tree.flatten(info)
  assert len(leaves) == 2
  assert jax.tree.unflatten(treedef, leaves) == info

  @jax.jit
  def f(info):
    return info.replace(step=info.next_step * 10), jnp.where(info.log, info.next_step, -1)

  out, value = f(info)
  assert isinstance(out, StepInfo)
  assert int(out.step) == 70 and bool(out.log) is True
  assert int(value) == 7
  _, value = f(StepInfo(step=jnp.asarray(6, jnp.int32), log=jnp.asarray(False)))
  assert int(value) == -1
  # traced: the same rule the host uses, on device
  hits = jax.jit(jax.vmap(lambda s: StepInfo(step=s, log=False).next_step % 3 == 0))(
      jnp.arange(10))
  np.testing.assert_array_equal(np.flatnonzero(np.asarray(hits)), [2, 5, 8])


def test_step_info_from_python_ints_traces_once_per_structure():
  traces = []

  @jax.jit
  def g(info):
    traces.append(1)
    return info.step + jnp.asarray(info.log, jnp.int32)

  assert int(g(StepInfo(step=3, log=True))) == 4
  assert int(g(StepInfo(step=5, log=False))) == 5    # the values are traced, not static
  assert len(traces) == 1
