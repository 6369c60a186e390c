"""Orbax checkpoints of the whole train state: save, restore-or-init, always from the workdir.

What happens to each kind of bad checkpoint (docs/resuming.md):
- one that does not match the config (other shapes, other sparse layers, other method state)
  is never overwritten: restoring raises `CheckpointMismatchError` before anything is
  written, and the workdir is left exactly as it was;
- one that cannot be read (a truncated file, a partial copy, a flaky disk) is skipped with a
  loud warning and the newest readable one is restored; the damaged ones newer than it are
  moved aside to `<workdir>/checkpoints_damaged/`, never deleted, so the run can save those
  steps again;
- if none can be read, `NoReadableCheckpointError`, and nothing is moved;
- a save that fails (a full disk: ENOSPC) raises `CheckpointSaveError`, which stops the run.
  Orbax writes a checkpoint to a temporary directory and renames it when complete, and drops
  old checkpoints only after that, so the previous checkpoint stays intact and readable.
"""
from __future__ import annotations

import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from flax import traverse_util
from jax.experimental import multihost_utils

DAMAGED_DIR = "checkpoints_damaged"


class CheckpointMismatchError(ValueError):
  """The checkpoint in the workdir does not fit the state this config builds."""


class NoReadableCheckpointError(RuntimeError):
  """The workdir has checkpoints, and none of them can be read."""


class CheckpointSaveError(RuntimeError):
  """Writing a checkpoint failed (e.g. the disk is full); the previous one is intact."""


def _flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  flat = traverse_util.flatten_dict(_to_dict(tree), sep="/")
  return {k: (tuple(v.shape), str(v.dtype)) for k, v in flat.items()
          if hasattr(v, "shape")}


def _to_dict(tree: Any) -> Any:
  """Nested dicts with string keys, for comparing a state with checkpoint metadata."""
  if hasattr(tree, "shape") and hasattr(tree, "dtype"):   # an array or its metadata
    return tree
  if hasattr(tree, "__dataclass_fields__"):        # TrainState
    return {k: _to_dict(getattr(tree, k)) for k in tree.__dataclass_fields__}
  if isinstance(tree, dict):
    return {str(k): _to_dict(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    fields = getattr(tree, "_fields", None)
    keys = fields if fields else range(len(tree))
    return {str(k): _to_dict(v) for k, v in zip(keys, tree)}
  return tree


class Checkpointer:
  """Thin wrapper over `ocp.CheckpointManager` rooted at `workdir/checkpoints`."""

  def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory,
        item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore_or_init(self, state: Any) -> Any:
    """The newest readable checkpoint restored into `state`'s structure, or `state` if there
    is none (module docstring: what happens to damaged or mismatched ones)."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      return state
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    damaged = []
    for step in steps:
      self._check_compatible(step, state)   # a mismatch stops here: nothing is changed
      try:
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("CHECKPOINT DAMAGED: the checkpoint at step %d in %s cannot be read "
                        "(%s: %s); trying the one before it.", step, self.directory,
                        type(e).__name__, str(e)[:500])
        damaged.append(step)
        continue
      if damaged:
        self._set_aside(damaged)
        logging.warning("resuming from step %d, the newest readable checkpoint; the damaged "
                        "ones (steps %s) were moved to %s", step, damaged, self.damaged_dir)
      logging.info("restored checkpoint at step %d from %s", step, self.directory)
      return restored
    raise NoReadableCheckpointError(
        f"none of the checkpoints in {self.directory} (steps {steps}) can be read into the "
        "state this config builds (the warnings above say why for each). Nothing in the "
        "workdir was changed. If they were written by another config, use that config "
        "(workdir/config.json); otherwise restore them from a copy, or start a new --workdir.")

  @property
  def damaged_dir(self) -> str:
    return os.path.join(os.path.dirname(self.directory), DAMAGED_DIR)

  def _set_aside(self, steps: list[int]) -> None:
    """Moves the damaged checkpoints out of Orbax's directory (so the run can save those
    steps again and no rotation deletes them), under a timestamped name."""
    if jax.process_index() == 0:
      os.makedirs(self.damaged_dir, exist_ok=True)
      stamp = time.strftime("%Y%m%d-%H%M%S")
      for step in steps:
        os.rename(os.path.join(self.directory, str(step)),
                  os.path.join(self.damaged_dir, f"{step}.{stamp}"))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("s24jax: damaged checkpoints set aside")
    self.manager.reload()

  def _check_compatible(self, step: int, state: Any) -> None:
    try:
      meta = self.manager.item_metadata(step)
    except Exception:  # pylint: disable=broad-except
      return  # let restore() report what is wrong
    tree = getattr(meta, "tree", meta)
    if tree is None:
      return
    want, have = _flat_shapes(state), _flat_shapes(tree)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    shapes = sorted(k for k in set(want) & set(have) if want[k][0] != have[k][0])
    if missing or extra or shapes:
      lines = [f"checkpoint at step {step} in {self.directory} does not match this config:"]
      if missing:
        lines.append(f"  missing in the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
      if extra:
        lines.append(f"  only in the checkpoint: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
      for k in shapes[:8]:
        lines.append(f"  {k}: checkpoint {have[k][0]} vs config {want[k][0]}")
      lines.append("Nothing in the workdir was changed; use the config that wrote it "
                   "(workdir/config.json) or a new --workdir.")
      raise CheckpointMismatchError("\n".join(lines))

  def save(self, step: int, state: Any, *, force: bool = False) -> bool:
    """Starts writing the checkpoint of `step` (async: a failure may surface at the next
    save or at `wait`). Raises CheckpointSaveError."""
    try:
      return self.manager.save(step, args=ocp.args.StandardSave(state), force=force)
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(step, e) from e

  def wait(self) -> None:
    """Waits for the save in flight; raises CheckpointSaveError if it failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(None, e) from e

  def _save_error(self, step: int | None, e: Exception) -> CheckpointSaveError:
    try:
      self.manager.reload()
      good = self.manager.latest_step()
    except Exception:  # pylint: disable=broad-except
      good = None
    what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
    where = (f"The newest complete checkpoint, step {good}, is intact; free space (or fix the "
             "disk) and run the same command again to resume from it."
             if good is not None else "There is no complete checkpoint yet.")
    return CheckpointSaveError(f"saving {what} in {self.directory} failed "
                               f"({type(e).__name__}: {e}). Training stopped. {where}")

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()
