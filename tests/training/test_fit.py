"""s24jax/training/fit.py: a run whose train step does not fit the device's memory stops before step 1
(exit code 6, one line, nothing written) and names a setting that does fit; a run that fits runs
the executable compiled for the check (the same losses as the jitted step)."""
import os
import types

import jax
import pytest

from s24jax import errors
from s24jax.training import fit
from s24jax.training import loop

from tiny import tiny_config

GIB = 2 ** 30


def _config(tmp_path, data_cache, **overrides):
  return tiny_config("ste", steps=2, workdir_cache=data_cache,
                     overrides={"batch_size": 8, "log_every": 1, "eval_every": 2, **overrides})


def _needed(config, accum: int) -> int:
  """The bytes XLA's buffer assignment gives the step at `accum` micro-batches: an
  independent compile through the jitted step's own lowering."""
  from s24jax.training import validate   # pylint: disable=g-import-not-at-top
  config = config.copy_and_resolve_references()
  config.grad_accum_steps = accum
  checked = validate.check_run(config, "/nonexistent/s24jax_fit_probe")
  first = fit.first_step(config, checked, "/nonexistent/s24jax_fit_probe")
  return first.needed


def test_a_step_that_does_not_fit_stops_before_anything_is_written(tmp_path, data_cache,
                                                                   monkeypatch):
  config = _config(tmp_path, data_cache)
  full, quarter = _needed(config, 1), _needed(config, 4)
  assert quarter < full                      # the micro-batch is what the suggestion shrinks
  # A device between the two: the configured step cannot run, 4 micro-batches can.
  capacity = int((full + quarter) / 2 / (1 - fit.HEADROOM))
  monkeypatch.setattr(fit, "device_capacity", lambda dev: (capacity, "the fake memory"))
  workdir = tmp_path / "run"
  with pytest.raises(fit.DoesNotFit) as e:
    loop.train_and_evaluate(config, str(workdir), source="experiments/gpt2_ste.py:tiny")
  msg = str(e.value)
  assert e.value.exit_code == errors.EXIT_DOES_NOT_FIT == 6
  assert "\n" not in msg and "nothing was written" in msg, msg
  assert f"{full / GIB:.1f} GiB" in msg and "the fake memory" in msg, msg
  on_cpu = jax.devices()[0].platform == "cpu"                    # (a GPU host's: its GPU)
  assert ("--config experiments/gpt2_ste.py:small" in msg) == on_cpu, msg   # the CPU test bed
  assert ("on this CPU a train step costs about" in msg and "2 steps would take" in msg
          ) == on_cpu, msg
  assert not workdir.exists() or not any(workdir.iterdir()), list(workdir.iterdir())
  # The setting it names fits: that run goes ahead on the same device.
  accum = int(msg.split("--config.grad_accum_steps=")[1].split()[0])
  assert 1 < accum and _needed(config, accum) <= capacity * (1 - fit.HEADROOM)
  config.grad_accum_steps = accum
  final = loop.train_and_evaluate(config, str(workdir))
  assert final["step"] == 2


def test_no_micro_batch_fits_says_so(tmp_path, data_cache, monkeypatch):
  config = _config(tmp_path, data_cache)
  monkeypatch.setattr(fit, "device_capacity", lambda dev: (1024, "a tiny memory"))
  with pytest.raises(fit.DoesNotFit, match="No micro-batch fits on its own.*fsdp"):
    loop.train_and_evaluate(config, str(tmp_path / "run"))


def test_the_run_uses_the_checked_executable_and_loses_nothing_by_it(tmp_path, data_cache,
                                                                    monkeypatch):
  """The loop's steps through the executable compiled for the check give the losses of the
  jitted train step (the same program: compared to the bit), and the jitted step is not
  traced again for that model."""
  config = _config(tmp_path, data_cache)
  got = loop.train_and_evaluate(config, str(tmp_path / "a"))
  calls = []
  real = loop.Run.train_step

  def jitted_only(self, state, batch, info):   # what the loop did before fit.py
    calls.append(info.step)
    self.first = None
    return real(self, state, batch, info)

  monkeypatch.setattr(loop.Run, "train_step", jitted_only)
  want = loop.train_and_evaluate(config, str(tmp_path / "b"))
  assert calls == [0, 1]
  assert got["train/loss"] == want["train/loss"] and got["val/loss"] == want["val/loss"]


def test_capacity_of_a_cpu_is_what_the_kernel_says_is_available():
  cap, what = fit.device_capacity(jax.devices("cpu")[0])
  with open("/proc/meminfo", encoding="ascii") as f:
    avail = [int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:")]
  assert "available" in what and avail and abs(cap - avail[0]) < 2 * GIB


def test_a_gpus_capacity_is_its_allocators_limit():
  dev = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                              memory_stats=lambda: {"bytes_limit": 80 * GIB})
  assert fit.device_capacity(dev) == (80 * GIB, "this NVIDIA H100 80GB HBM3's memory")


@pytest.mark.parametrize("seconds,want", [(0.094, "0.094 s"), (150, "2.5 minutes"),
                                          (3 * 3600, "3.0 hours"), (30 * 86400, "30.0 days")])
def test_durations_read_plainly(seconds, want):
  assert fit._duration(seconds) == want   # pylint: disable=protected-access
