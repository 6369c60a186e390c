"""Orbax checkpoints of the whole train state: save, restore-or-init, always from the workdir.

What happens to each kind of bad checkpoint (docs/resuming.md):
- one that does not match the config (other shapes, other sparse layers, other method state)
  is never overwritten: `find_mismatch` finds it before anything is written (s24jax/training/validate.py
  names the config fields that differ), and restoring raises `CheckpointMismatchError` too;
  the workdir is left exactly as it was;
- one that cannot be read (a truncated file, a partial copy, a flaky disk) is skipped and the
  newest readable one is restored; the damaged ones newer than it are moved aside to
  `<workdir>/checkpoints_damaged/`, never deleted, so the run can save those steps again; one
  warning line says so (the steps, their folder, why: the library's error of one line, not
  its dump of the array's spec);
- if none can be read, `NoReadableCheckpointError` (one line, the newest's reason), and
  nothing is moved;
- a save that fails (a full disk: ENOSPC) raises `CheckpointSaveError`, which stops the run
  within a step of the failure (`Checkpointer.poll`, every step), naming the step, its path and
  the previous checkpoint. Orbax writes a checkpoint to a temporary directory and renames it
  when complete, and drops old checkpoints only after that, so the previous checkpoint stays
  intact and readable; the temporary directory a failed or killed save leaves is removed
  when the next run opens the checkpoints.
"""
from __future__ import annotations

import contextlib
import errno
import logging as std_logging
import math
import os
import shutil
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import traverse_util
from jax.experimental import multihost_utils

from s24jax import errors

CHECKPOINTS = "checkpoints"          # <workdir>/checkpoints: Orbax's directory
DAMAGED_DIR = "checkpoints_damaged"
# Free space for fewer checkpoints than this (the kept ones, the one being written) warns.
CHECKPOINTS_WARN = 3


class CheckpointMismatchError(errors.UserError):
  """The checkpoint in the workdir does not fit the state this config builds."""


class NoReadableCheckpointError(errors.KnownError, RuntimeError):
  """The workdir has checkpoints, and none of them can be read."""
  exit_code = errors.EXIT_STORAGE


class CheckpointSaveError(errors.KnownError, RuntimeError):
  """Writing a checkpoint failed (e.g. the disk is full); the previous one is intact."""
  exit_code = errors.EXIT_STORAGE


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


def _metadata_tree(manager: ocp.CheckpointManager, step: int) -> Any:
  """The checkpoint's tree of array metadata, or None if it cannot be read."""
  try:
    meta = manager.item_metadata(step)
  except Exception:  # pylint: disable=broad-except
    return None
  return getattr(meta, "tree", meta)


def state_difference(tree: Any, state: Any) -> str | None:
  """Where the checkpoint's tree differs from `state` (paths only in one of them, different
  shapes), on one line; None if they agree."""
  want, have = _flat_shapes(state), _flat_shapes(tree)
  missing = sorted(set(want) - set(have))
  extra = sorted(set(have) - set(want))
  # The params first (what a user recognizes), the optimizer's copies of them last.
  first = {"params": 0, "sparsity": 1, "method_state": 2}
  order = lambda k: (first.get(k.split("/")[0], 3), k)  # pylint: disable=unnecessary-lambda-assignment
  missing, extra = sorted(missing, key=order), sorted(extra, key=order)
  shapes = sorted((k for k in set(want) & set(have) if want[k][0] != have[k][0]), key=order)
  if not (missing or extra or shapes):
    return None
  more = lambda xs: " ..." if len(xs) > 6 else ""   # pylint: disable=unnecessary-lambda-assignment
  parts = []
  if missing:
    parts.append(f"missing in the checkpoint: {', '.join(missing[:6])}{more(missing)}")
  if extra:
    parts.append(f"only in the checkpoint: {', '.join(extra[:6])}{more(extra)}")
  parts += [f"{k}: checkpoint {have[k][0]} vs config {want[k][0]}" for k in shapes[:6]]
  return "; ".join(parts)


def find_mismatch(directory: str, state: Any) -> tuple[int, str] | None:
  """(step, where it differs) if the newest checkpoint in `directory` whose metadata can be
  read does not fit `state` (arrays or their shapes); None if it fits or there is none.
  Reads only: the directory is opened read-only, nothing is created or removed."""
  if not os.path.isdir(directory):
    return None
  # Orbax's notes on a read-only manager ("Given directory is read only") and on a damaged
  # checkpoint's metadata are not for the user: restore_or_init reports damage in one line.
  with _library_logs_at(std_logging.CRITICAL):
    manager = ocp.CheckpointManager(
        directory, item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(read_only=True, create=False,
                                             enable_async_checkpointing=False))
    try:
      for step in sorted(manager.all_steps(), reverse=True):
        tree = _metadata_tree(manager, step)
        if tree is None:
          continue   # damaged: restore_or_init sets it aside
        diff = state_difference(tree, state)
        return (step, diff) if diff else None
      return None
    finally:
      manager.close()


@contextlib.contextmanager
def _library_logs_at(level: int):
  """Orbax's log records (absl's logger) below `level` dropped inside the block."""
  logger = std_logging.getLogger("absl")
  old = logger.level
  logger.setLevel(level)
  try:
    yield
  finally:
    logger.setLevel(old)


def newest_step_on_disk(workdir: str) -> int | None:
  """The newest checkpoint's step in the workdir, by its folder's name (None: none), read
  without opening Orbax."""
  directory = os.path.join(workdir, CHECKPOINTS)
  steps = [int(n) for n in os.listdir(directory) if n.isdigit()] if os.path.isdir(directory) else []
  return max(steps, default=None)


def checkpoint_bytes(state: Any) -> int:
  """The size of one checkpoint of `state` (arrays or their shapes): its bytes, as Orbax
  stores them."""
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)))


def free_bytes(path: str) -> int:
  """Free bytes on the filesystem that holds `path` (or would: its nearest existing parent)."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return shutil.disk_usage(path).free


def _size(n: float) -> str:
  return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def check_disk(state: Any, workdir: str) -> None:
  """Before a run: a UserError if one checkpoint of `state` does not fit the free space of
  the workdir's filesystem, a warning if fewer than CHECKPOINTS_WARN do."""
  need, free = checkpoint_bytes(state), free_bytes(workdir)
  if free < need:
    raise errors.UserError(f"{workdir}: {_size(free)} free, but one checkpoint of this run "
                           f"takes about {_size(need)}. Free space there, or choose another "
                           "--workdir")
  if free < need * CHECKPOINTS_WARN:
    logging.warning("LOW DISK SPACE: %s has %s free, room for %d checkpoint(s) of %s; a save "
                    "will fail when the disk fills (the previous checkpoint stays intact)",
                    workdir, _size(free), free // need, _size(need))


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def reason(e: BaseException) -> str:
  """Why a read or write failed, in one short line: 'No space left on device (the disk is
  full)' wherever in the chain of causes that is (Orbax wraps tensorstore's error in a
  ValueError), else the first error of the chain whose message is one line (a failed read's
  is Orbax's, then tensorstore's message of one line under it: the array, the file, what is
  wrong with it), else the error's first line."""
  seen, x, chain = set(), e, []
  while x is not None and id(x) not in seen:
    seen.add(id(x))
    if (isinstance(x, OSError) and x.errno in DISK_FULL) or "No space left on device" in str(x):
      return "No space left on device: the disk is full"
    chain.append(x)
    x = x.__cause__ or x.__context__
  x = next((c for c in chain if len(str(c).strip().splitlines()) == 1), e)
  return f"{type(x).__name__}: {x}".strip().splitlines()[0][:300]


class Checkpointer:
  """Thin wrapper over `ocp.CheckpointManager` rooted at `workdir/checkpoints`."""

  def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True):
    self.directory = os.path.join(os.path.abspath(workdir), CHECKPOINTS)
    self.manager = ocp.CheckpointManager(
        self.directory,
        item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
            # What a killed or failed save left (<step>.orbax-checkpoint-tmp): never a
            # checkpoint, and in the way of saving that step again.
            cleanup_tmp_directories=True))
    self._saving: int | None = None   # the step of the save in flight

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def restore_or_init(self, state: Any) -> Any:
    """The newest readable checkpoint restored into `state`'s structure, or `state` if there
    is none (module docstring: what happens to damaged or mismatched ones)."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      return state
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    damaged: dict[int, str] = {}   # step -> why it cannot be read, newest first
    for step in steps:
      self._check_compatible(step, state)   # a mismatch stops here: nothing is changed
      try:
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
      except Exception as e:  # pylint: disable=broad-except
        damaged[step] = reason(e)
        continue
      if damaged:
        self._set_aside(list(damaged))
        logging.warning("%s", self._damaged_line(damaged, step))
      logging.info("restored checkpoint at step %d from %s", step, self.directory)
      return restored
    raise NoReadableCheckpointError(
        f"none of the checkpoints in {self.directory} (steps {steps}) can be read into the "
        f"state this config builds (step {steps[0]}: {damaged[steps[0]]}). Nothing in the "
        "workdir was changed but its train.log. If they were written by another config, use "
        "that config (workdir/config.json); otherwise restore them from a copy, or start a "
        "new --workdir.")

  def _damaged_line(self, damaged: dict[int, str], restored: int) -> str:
    """The one line that says which checkpoints could not be read (`damaged`), why, where
    they went and what the run does: it resumes from `restored`."""
    newest = next(iter(damaged))
    one = len(damaged) == 1
    what = (f"the checkpoint of step {newest} ({self.path(newest)})" if one else
            f"the checkpoints of steps {', '.join(map(str, damaged))} in {self.directory}")
    why = damaged[newest] if one else f"step {newest}: {damaged[newest]}"
    moved, it = ("it was", "it") if one else ("they were", "them")
    return (f"CHECKPOINT DAMAGED: {what} cannot be read ({why}). Resuming from step "
            f"{restored}, the newest readable checkpoint (the steps after it are trained "
            f"again); {moved} moved to {self.damaged_dir}, not deleted: delete {it} once no "
            "longer needed.")

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
    tree = _metadata_tree(self.manager, step)
    if tree is None:
      return  # let restore() report what is wrong
    diff = state_difference(tree, state)
    if diff:
      raise CheckpointMismatchError(
          f"checkpoint at step {step} in {self.directory} does not match this config: {diff}. "
          "Nothing in the workdir was changed; use the config that wrote it "
          "(workdir/config.json) or a new --workdir.")

  def save(self, step: int, state: Any, *, force: bool = False) -> bool:
    """Starts writing the checkpoint of `step` (async: `poll` and `wait` report a failure).
    Raises CheckpointSaveError (the previous save's failure, named by its step, or this
    one's)."""
    if self._saving is not None:
      self.wait()   # Orbax waits for it anyway; its failure is that step's, not this one's
    try:
      saved = self.manager.save(step, args=ocp.args.StandardSave(state), force=force)
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(step, e) from e
    if saved:
      self._saving = step
    return saved

  def poll(self) -> None:
    """Raises CheckpointSaveError if the save in flight has failed; a local check, cheap
    enough for every step (the loop calls it after each one)."""
    if self._saving is not None and not self.manager.is_saving_in_progress():
      self.wait()

  def wait(self) -> None:
    """Waits for the save in flight; raises CheckpointSaveError if it failed."""
    step, self._saving = self._saving, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(step, e) from e

  def _save_error(self, step: int | None, e: Exception) -> CheckpointSaveError:
    try:
      self.manager.reload()
      good = self.manager.latest_step()
    except Exception:  # pylint: disable=broad-except
      good = None
    what = (f"the checkpoint of step {step} to {self.path(step)}" if step is not None
            else f"a checkpoint in {self.directory}")
    where = (f"The previous checkpoint, step {good} ({self.path(good)}), is intact: free space "
             "(or fix the disk) and run the same command again to resume from it."
             if good is not None else "There is no complete checkpoint yet: free space (or "
             "fix the disk) and run the same command again.")
    return CheckpointSaveError(f"saving {what} failed ({reason(e)}). Training stopped. {where}")

  def disk_full(self, e: OSError) -> CheckpointSaveError:
    """A write of the run's own (metrics, logs) found the disk full: the same stop as a
    failed save, naming the file and the newest complete checkpoint."""
    good = max((int(n) for n in os.listdir(self.directory) if n.isdigit()), default=None)
    where = (f"The newest checkpoint, step {good} ({self.path(good)}), is intact: free space "
             "and run the same command again to resume from it." if good is not None else
             "There is no complete checkpoint yet: free space and run the same command again.")
    return CheckpointSaveError(f"writing {e.filename or 'a file of the run'} failed "
                               f"({reason(e)}). Training stopped. {where}")

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()
