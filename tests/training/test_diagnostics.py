"""Tests of s24jax/training/diagnostics.py's paired cost measurement (MVUE's cost): a known extra cost
injected into one of two programs (known: a multiple of the other's work) is found above its
stated noise and of that size; two identical programs give a cost within its noise of zero (never
negative beyond it); and the MVUE chore logs the four metrics.

Timings on a shared 2-core machine are noisy: the injected work is several times the base
work, so its cost stands far above the noise; the band against the independent timing is
wide (a factor of 2), since the point is the sign and the size, not a speed."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.training import diagnostics
from s24jax.kernels import timing
from s24jax.training.run_spec import RunSpec
from s24jax.step_info import StepInfo

from train_helpers import tiny_setup


def _work(x, w, rounds):
  for _ in range(rounds):
    x = jnp.tanh(x @ w)      # (512, 512): serial, each round needs the last
  return x


@pytest.fixture(scope="module")
def operands():
  """On the CPU on every host (committed there, so the timed programs run there): the tests
  check the measurement, whose injected work must dwarf the loop's own per-call cost; on a
  GPU a (512, 512) round is a few microseconds, the size of a kernel launch."""
  kx, kw = jax.random.split(jax.random.key(0))
  cpu = jax.devices("cpu")[0]
  return (jax.device_put(jax.random.normal(kx, (512, 512), jnp.float32), cpu),
          jax.device_put(jax.random.normal(kw, (512, 512), jnp.float32) / 23, cpu))


def test_an_injected_cost_is_measured_as_the_work_injected(operands):
  """`on` does the rounds of `off` and 3 times as many more: its cost is 3 times `off`'s
  time, whatever the machine's speed or load (both are timed in the same interleaved pairs)."""
  base, extra = 2, 6
  off = lambda x, w: _work(x, w, base)
  on = lambda x, w: _work(_work(x, w, base), w, extra)
  cost = diagnostics.paired_cost(on, off, operands, pairs=9, loop_seconds=0.05)
  assert cost.resolved and cost.seconds - cost.noise > 0, cost
  off_seconds = cost.on_seconds - cost.seconds
  assert 1.5 < cost.seconds / off_seconds < 6, cost          # extra / base = 3
  metrics = diagnostics.mvue_metrics(cost)
  assert metrics["perf/mvue_time_share"] == pytest.approx(cost.seconds / cost.on_seconds)
  assert 0.6 < metrics["perf/mvue_time_share"] < 0.86, metrics   # 3/4 (the band above)


def test_identical_programs_cost_nothing_beyond_the_noise(operands):
  """The same program on both sides: the true cost is 0, so the interval holds it unless 20
  of 21 pairs fall on one side (probability 2 * 22 / 2^21, about 2e-5)."""
  same = lambda x, w: _work(x, w, 2)
  cost = diagnostics.paired_cost(same, same, operands, pairs=21, loop_seconds=0.01)
  assert cost.noise >= 0 and not cost.resolved, cost
  assert cost.seconds >= -cost.noise, cost


def test_the_loop_calls_leave_the_values_as_they_are(operands):
  """kernels/timing.py `in_loop`: the arguments are varied so XLA cannot hoist the call, but
  their values stay the same (floats) or follow a stated rule (each call's key is the
  last call's folded with the iteration): the loop's result is exactly the last call's."""
  x, w = operands
  f = lambda x, w, key: _work(x, w, 1) + jax.random.normal(key, x.shape)
  key = jax.random.key(3)
  with jax.default_device(jax.devices("cpu")[0]):    # float32 dots in float32 (no TF32)
    got = jax.jit(timing.in_loop(f), static_argnums=0)(3, x, w, key)
    for i in range(3):                     # the key of call i: the last call's folded with i
      key = jax.random.fold_in(key, i)
    want = jax.jit(f)(x, w, key)
  # Same values, same random bits; only XLA's summation order may differ between the two
  # programs: |x @ w| sums 512 products of O(1/sqrt(512)) terms, so a reordering moves it by
  # at most ~512 float32 ulps of 1 (6e-5), and tanh does not amplify that.
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_fewer_than_three_pairs_are_refused(operands):
  with pytest.raises(ValueError, match="at least 3 pairs"):
    diagnostics.paired_cost(jnp.add, jnp.add, operands, pairs=2)


def test_the_mvue_chore_logs_its_cost_with_the_noise():
  """The chore as the loop runs it, after the first logged step, on the tiny S-STE model."""
  cfg, _, _, state, batch = tiny_setup("s_ste", {"sparsity.mvue": True, "sparsity.fp8": False})
  spec = RunSpec.build(cfg)
  written = []
  run = types.SimpleNamespace(
      model_cfg=spec.model_cfg, state=state, batch=batch,
      info=StepInfo.at(int(cfg.log_every) - 1, log_every=int(cfg.log_every), total=10),
      write=lambda step, scalars: written.append((step, scalars)))
  [chore] = diagnostics.mvue_cost_chores(cfg)
  assert chore.is_due(run.info, 10) and not chore.is_due(StepInfo.at(1, log_every=1, total=10),
                                                          10)
  chore.fn(run)
  [(step, r)] = written
  assert step == cfg.log_every
  assert r["perf/mvue_seconds_noise"] >= 0 and r["perf/mvue_time_share_noise"] >= 0, r
  assert all(v == v for v in r.values()), r                  # no NaN
  # Both shares are over the same on-step time.
  assert r["perf/mvue_time_share"] * r["perf/mvue_seconds_noise"] == pytest.approx(
      r["perf/mvue_time_share_noise"] * r["perf/mvue_seconds"], rel=1e-9, abs=1e-15), r
