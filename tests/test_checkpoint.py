"""Tests for s24jax/checkpoint.py through the loop: a damaged newest checkpoint is set aside
and the run resumes from the previous one to an undisturbed run's losses (the reference: the
same config trained without interruption), each step logged once; with none readable, a
clear error and an unchanged workdir; a full disk (ENOSPC injected into Orbax's save) stops
the run and keeps the previous checkpoint restorable."""
import errno
import json
import os

import orbax.checkpoint as ocp
import pytest

from s24jax import checkpoint as ckpt_lib
from s24jax import loop
from s24jax.run_spec import RunSpec

from train_helpers import STEPS, assert_each_step_once, digest, losses, run_config


def _truncate_largest(directory):
  files = [os.path.join(r, n) for r, _, ns in os.walk(directory) for n in ns]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.truncate(min(1000, os.path.getsize(largest) // 2))
  return largest


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    undisturbed, tmp_path, data_cache):
  workdir = str(tmp_path / "damaged")
  # Checkpoints on log steps (5, 10, ..., 20, 24; 3 kept), so a resume logs as before.
  loop.train_and_evaluate(run_config(data_cache, checkpoint_every=5), workdir)
  os.remove(os.path.join(workdir, "final_metrics.json"))   # as if killed before the end
  _truncate_largest(os.path.join(workdir, "checkpoints", str(STEPS)))
  final = loop.train_and_evaluate(run_config(data_cache, checkpoint_every=5), workdir)
  assert losses(workdir) == losses(undisturbed)
  assert_each_step_once(workdir)
  aside = os.listdir(os.path.join(workdir, ckpt_lib.DAMAGED_DIR))
  assert len(aside) == 1 and aside[0].startswith(f"{STEPS}."), aside   # moved, not deleted
  assert final["step"] == STEPS
  superseded = os.path.join(workdir, "metrics.superseded.jsonl")
  assert STEPS in {json.loads(l)["step"] for l in open(superseded)}   # kept, out of the way
  # Now none readable: a clear error, and nothing in the workdir changes.
  os.remove(os.path.join(workdir, "final_metrics.json"))
  for step in os.listdir(os.path.join(workdir, "checkpoints")):
    _truncate_largest(os.path.join(workdir, "checkpoints", step))
  before = digest(workdir)
  with pytest.raises(ckpt_lib.NoReadableCheckpointError, match="Nothing in the workdir"):
    loop.train_and_evaluate(run_config(data_cache, checkpoint_every=5), workdir)
  assert digest(workdir) == before


@pytest.mark.slow
def test_a_full_disk_stops_the_run_and_keeps_the_previous_checkpoint(
    tmp_path, data_cache, monkeypatch):
  workdir = str(tmp_path / "full_disk")
  real = ocp.StandardCheckpointHandler.async_save
  calls = []

  def failing(self, *args, **kwargs):   # the third save (step 6) finds the disk full
    calls.append(1)
    if len(calls) >= 3:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(self, *args, **kwargs)

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", failing)
  with pytest.raises(ckpt_lib.CheckpointSaveError, match="No space left") as e:
    loop.train_and_evaluate(run_config(data_cache, checkpoint_every=3), workdir)
  assert "step 3, is intact" in str(e.value)
  monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", real)
  fresh = RunSpec.build(run_config(data_cache)).fresh_state(0)
  ckpt = ckpt_lib.Checkpointer(workdir)
  assert ckpt.latest_step() == 3
  assert int(ckpt.restore_or_init(fresh).step) == 3
  ckpt.close()
