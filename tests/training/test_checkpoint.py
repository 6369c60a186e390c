"""Tests for s24jax/training/checkpoint.py through the loop: a damaged newest checkpoint is set aside
and the run resumes from the previous one to an undisturbed run's losses (the reference: the
same config trained without interruption), each step logged once; with none readable, a
clear error and an unchanged workdir; a full disk (ENOSPC injected into the background write
of Orbax's save, where a real one happens) stops the run before the next checkpoint with one
line naming the step, its path and the intact previous checkpoint, which is restorable, and
the same command then (space freed) resumes to the undisturbed run's losses."""
import errno
import json
import logging
import os

import orbax.checkpoint as ocp
import pytest

from s24jax.training import checkpoint as ckpt_lib
from s24jax import errors
from s24jax.training import loop
from s24jax.training.run_spec import RunSpec

from train_helpers import STEPS, assert_each_step_once, digest, losses, run_config


def _truncate_largest(directory):
  files = [os.path.join(r, n) for r, _, ns in os.walk(directory) for n in ns]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.truncate(min(1000, os.path.getsize(largest) // 2))
  return largest


def test_a_failed_reads_reason_is_the_libraries_one_line_error():
  """Orbax raises a 58-line message (a TensorStore spec) from tensorstore's error of one line
  (the array, the file, what is wrong); the reason is that line, and a full disk anywhere in
  the chain is said as such. The messages here are written out as the libraries give them."""
  spec = "Encountered error while reading array index: (slice(0, 512, 1),). See full " + (
      "TensorStore details: <bound method spec of TensorStore({\n  'base': {\n" * 20) + "})>."
  cause = ValueError('OUT_OF_RANGE: Error reading "params.wpe/0.0" in OCDBT database at local '
                     'file "/w/checkpoints/6/default/": Requested byte range [1115870, '
                     '1146213) is not valid for value of size 1000')
  try:
    try:
      raise cause
    except ValueError as e:
      raise Exception(spec) from e   # pylint: disable=broad-exception-raised
  except Exception as e:  # pylint: disable=broad-except
    assert ckpt_lib.reason(e) == f"ValueError: {cause}"
  full = RuntimeError("a save failed:\nsee below")
  full.__cause__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  assert ckpt_lib.reason(full) == "No space left on device: the disk is full"
  assert ckpt_lib.reason(KeyError("x")) == "KeyError: 'x'"


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    undisturbed, tmp_path, data_cache, caplog):
  workdir = str(tmp_path / "damaged")
  # Checkpoints on log steps (5, 10, ..., 20, 24; 3 kept), so a resume logs as before.
  loop.train_and_evaluate(run_config(data_cache, checkpoint_every=5), workdir)
  os.remove(os.path.join(workdir, "final_metrics.json"))   # as if killed before the end
  _truncate_largest(os.path.join(workdir, "checkpoints", str(STEPS)))
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    final = loop.train_and_evaluate(run_config(data_cache, checkpoint_every=5), workdir)
  assert losses(workdir) == losses(undisturbed)
  assert_each_step_once(workdir)
  aside = os.listdir(os.path.join(workdir, ckpt_lib.DAMAGED_DIR))
  assert len(aside) == 1 and aside[0].startswith(f"{STEPS}."), aside   # moved, not deleted
  # One line says it (it was a 50-line TensorStore spec): the step, its folder, why, the step
  # resumed from, where the damaged one went.
  said = [r.getMessage() for r in caplog.records if "DAMAGED" in r.getMessage()]
  assert len(said) == 1 and "\n" not in said[0] and "TensorStore" not in said[0], said
  directory = os.path.join(workdir, "checkpoints")
  assert said[0].startswith(f"CHECKPOINT DAMAGED: the checkpoint of step {STEPS} "
                            f"({directory}/{STEPS}) cannot be read ("), said
  assert f"Resuming from step {(STEPS // 5) * 5}, the newest readable" in said[0], said
  assert f"moved to {os.path.join(workdir, ckpt_lib.DAMAGED_DIR)}, not deleted" in said[0]
  assert final["step"] == STEPS
  superseded = os.path.join(workdir, "metrics.superseded.jsonl")
  assert STEPS in {json.loads(l)["step"] for l in open(superseded)}   # kept, out of the way
  # Now none readable: a clear error, and nothing in the workdir changes.
  os.remove(os.path.join(workdir, "final_metrics.json"))
  for step in os.listdir(os.path.join(workdir, "checkpoints")):
    _truncate_largest(os.path.join(workdir, "checkpoints", step))
  before = digest(workdir)
  with pytest.raises(ckpt_lib.NoReadableCheckpointError, match="Nothing in the workdir") as e:
    loop.train_and_evaluate(run_config(data_cache, checkpoint_every=5), workdir)
  assert digest(workdir) == before
  newest = max(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")))
  assert f"(step {newest}: ValueError: " in str(e.value) and "TensorStore" not in str(e.value)
  assert e.value.exit_code == errors.EXIT_STORAGE and "\n" not in str(e.value)


class _DiskFull:
  """A commit future of Orbax's background write that fails as a full disk does."""

  def result(self, timeout=None):
    del timeout
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.slow
def test_a_full_disk_stops_the_run_at_once_and_keeps_the_previous_checkpoint(
    undisturbed, tmp_path, data_cache, monkeypatch):
  workdir = str(tmp_path / "full_disk")
  real = ocp.StandardCheckpointHandler.async_save
  calls = []

  async def failing(self, *args, **kwargs):   # the second save (step 10) fails in the background
    futures = await real(self, *args, **kwargs)
    calls.append(1)
    return list(futures or []) + ([_DiskFull()] if len(calls) == 2 else [])

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", failing)
  config = run_config(data_cache, checkpoint_every=10)   # logs every 5 steps
  with pytest.raises(ckpt_lib.CheckpointSaveError) as e:
    loop.train_and_evaluate(config, workdir)
  directory = os.path.join(workdir, "checkpoints")
  message = str(e.value)
  assert "\n" not in message and e.value.exit_code == errors.EXIT_STORAGE
  assert f"saving the checkpoint of step 10 to {directory}/10 failed" in message
  assert "No space left on device" in message
  assert f"The previous checkpoint, step 0 ({directory}/0), is intact" in message
  # Stopped when the write failed, not at the next save (step 20, logged first) as it used to.
  assert max(losses(workdir)) in (10, 15)
  monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", real)   # space freed
  fresh = RunSpec.build(run_config(data_cache)).fresh_state(0)
  ckpt = ckpt_lib.Checkpointer(workdir)
  assert ckpt.latest_step() == 0
  assert int(ckpt.restore_or_init(fresh).step) == 0
  ckpt.close()
  loop.train_and_evaluate(config, workdir)   # the same command again
  assert losses(workdir) == losses(undisturbed)
  assert_each_step_once(workdir)
