"""Orbax checkpoints of the whole train state: save, restore-or-init, always from the workdir.

A checkpoint that does not match the config (other shapes, other sparse layers, other
projection state) is never overwritten: restoring raises `CheckpointMismatchError` before
anything is written, and the workdir is left exactly as it was.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from flax import traverse_util


class CheckpointMismatchError(ValueError):
  """The checkpoint in the workdir does not fit the state this config builds."""


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
    """The latest checkpoint restored into `state`'s structure, or `state` if there is none."""
    step = self.latest_step()
    if step is None:
      return state
    self._check_compatible(step, state)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    try:
      restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointMismatchError(
          f"could not restore the checkpoint at step {step} in {self.directory} into the state "
          f"this config builds ({type(e).__name__}: {e}). Nothing in the workdir was changed; "
          "use the config that wrote it, or a new --workdir.") from e
    logging.info("restored checkpoint at step %d from %s", step, self.directory)
    return restored

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
    return self.manager.save(step, args=ocp.args.StandardSave(state), force=force)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
