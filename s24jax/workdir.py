"""One run per workdir, and the resolved config a run leaves in it.

A run holds `<workdir>/run.lock` (JSON: host, pid, start time) from before it writes anything
until it ends. A second run on the same workdir stops at once with an error that names the
holder (`WorkdirLockedError`), writing nothing. A lock left by a process that is no longer
alive on this host is taken over with a warning; a lock held from another host is never taken
over (its process cannot be checked from here): remove the file by hand if that run is gone.

The lock creates the workdir (and its missing parents) if needed, and removes what it
created, if still empty, when released: a run stopped by a bad config leaves no trace. A
workdir that cannot be created or written (a file in the way, no permission) is a
`UserError`.

`write_config` saves the resolved config as `config.json` at the first start; a resumed run
writes `config.resumed_at_<step>.json` only when a field really changed, and names the
changed fields in it and in a warning.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time
from typing import Any

from absl import logging
from flax import traverse_util
from ml_collections import config_dict

from s24jax import errors

LOCK_NAME = "run.lock"


class WorkdirLockedError(errors.KnownError, RuntimeError):
  """Another live run holds the workdir."""
  exit_code = errors.EXIT_LOCKED


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:   # exists, owned by someone else
    return True
  return True


class WorkdirLock:
  """`with WorkdirLock(workdir):` holds the workdir for this process (reentrant: a second
  acquire by the process that holds it is a no-op, so launch.py and the loop can both ask)."""

  _held: dict[str, int] = {}   # lock path -> nesting depth, in this process

  def __init__(self, workdir: str):
    self.path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
    self._created: list[str] = []   # the folders acquire() made, deepest first

  def _make_workdir(self) -> None:
    folder = os.path.dirname(self.path)
    missing = []
    while not os.path.exists(folder):
      missing.append(folder)
      folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
      raise errors.UserError(f"cannot create the workdir {os.path.dirname(self.path)}: "
                             f"{folder} is a file, not a folder; choose another --workdir")
    try:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
    except OSError as e:
      raise errors.UserError(f"cannot create the workdir {os.path.dirname(self.path)} "
                             f"({e.strerror}); choose another --workdir") from e
    self._created = missing

  def holder(self) -> dict[str, Any] | None:
    try:
      with open(self.path, encoding="utf-8") as f:
        return json.load(f)
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      return {"host": "?", "pid": -1, "started": "?", "unreadable": True}

  def acquire(self) -> None:
    if self._held.get(self.path):
      self._held[self.path] += 1
      return
    self._make_workdir()
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for _ in range(2):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except (PermissionError, IsADirectoryError, NotADirectoryError) as e:
        self._remove_created()
        raise errors.UserError(f"cannot write to the workdir {os.path.dirname(self.path)} "
                               f"({e.strerror}); choose another --workdir") from e
      except FileExistsError:
        other = self.holder()
        if other is None:   # released between the two calls: try again
          continue
        if (other.get("host") == me["host"] and isinstance(other.get("pid"), int)
            and not _alive(other["pid"])):
          logging.warning("taking over %s: its holder (pid %s on %s, started %s) is no longer "
                          "running", self.path, other.get("pid"), other.get("host"),
                          other.get("started"))
          os.remove(self.path)
          continue
        self._remove_created()
        raise WorkdirLockedError(
            f"{os.path.dirname(self.path)} is in use by another run (pid {other.get('pid')} on "
            f"{other.get('host')}, started {other.get('started')}; lock file {self.path}). "
            "Nothing was written. Wait for it to finish, use another --workdir, or, if that "
            "run is gone (e.g. on another host), remove the lock file.") from None
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(me, f)
      self._held[self.path] = 1
      return
    raise WorkdirLockedError(f"could not take {self.path}: it keeps reappearing")

  def release(self) -> None:
    depth = self._held.get(self.path, 0)
    if depth > 1:
      self._held[self.path] = depth - 1
      return
    self._held.pop(self.path, None)
    holder = self.holder()
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
      try:
        os.remove(self.path)
      except OSError as e:
        if e.errno != errno.ENOENT:
          raise
    self._remove_created()

  def _remove_created(self) -> None:
    """The folders acquire() created, if nothing was written in them (a stop before the run
    started: a bad config, a busy workdir)."""
    for folder in self._created:
      try:
        os.rmdir(folder)   # only if empty
      except OSError:
        break
    self._created = []

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


# ---------------------------------------------------------------------------------------------
# The resolved config.


def as_json(config: config_dict.ConfigDict) -> dict[str, Any]:
  """The config as config.json holds it."""
  return json.loads(config.to_json_best_effort(sort_keys=True))


def changed_fields(old: dict[str, Any], new: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """{dotted field: {'was': old value, 'now': new value}} for every field that differs
  (absent on one side: None)."""
  a = traverse_util.flatten_dict(old, sep=".")
  b = traverse_util.flatten_dict(new, sep=".")
  return {k: {"was": a.get(k), "now": b.get(k)} for k in sorted(set(a) | set(b))
          if a.get(k) != b.get(k)}


def last_config_path(workdir: str) -> str | None:
  """The file of the config the workdir's runs last used: the newest
  config.resumed_at_*.json, else config.json; None for a new workdir."""
  resumed = []
  for name in os.listdir(workdir) if os.path.isdir(workdir) else ():
    if name.startswith("config.resumed_at_") and name.endswith(".json"):
      try:
        resumed.append((int(name[len("config.resumed_at_"):-len(".json")]), name))
      except ValueError:
        continue
  for name in [n for _, n in sorted(resumed, reverse=True)] + ["config.json"]:
    path = os.path.join(workdir, name)
    if os.path.exists(path):
      return path
  return None


def last_config(workdir: str) -> dict[str, Any] | None:
  """The config the workdir's runs last used (`last_config_path`); None for a new workdir."""
  path = last_config_path(workdir)
  if path is None:
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except ValueError as e:
    raise errors.UserError(f"{path} is not valid JSON ({e}): restore it from a copy, or "
                           "start a new --workdir") from e
  return data.get("config", data) if os.path.basename(path) != "config.json" else data


def check_resumable(workdir: str) -> None:
  """A workdir written before 0.3 (the old key `projection` in its sparsity block) holds a
  train state this version cannot resume: say so, naming the new key, before anything is
  read."""
  old = last_config(workdir)
  if old and "projection" in old.get("sparsity", {}):
    raise errors.UserError(
        f"{workdir} was written by s24jax < 0.3: its config.json names the method under the "
        "old key 'projection', now sparsity.method, and its checkpoints hold the old train "
        "state (no method_state). Start a new --workdir, with --config.sparsity.method="
        f"{old['sparsity']['projection']!r}.")


def write_config(workdir: str, config: config_dict.ConfigDict, step: int) -> str | None:
  """Saves the resolved config: config.json at the first start (never overwritten); after a
  resume, config.resumed_at_<step>.json only if a field changed ({'changed': ..., 'config':
  ...}). Returns the path written, or None."""
  new = as_json(config)
  old = last_config(workdir)
  if old is None:
    path = os.path.join(workdir, "config.json")
    payload = new
  else:
    changed = changed_fields(old, new)
    if not changed:
      return None
    logging.warning("resuming at step %d with changed config fields: %s", step,
                    ", ".join(f"{k} ({v['was']!r} -> {v['now']!r})" for k, v in changed.items()))
    path = os.path.join(workdir, f"config.resumed_at_{step}.json")
    payload = {"changed": changed, "config": new}
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(payload, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
  return path


def supersede_metrics(workdir: str) -> None:
  """A run that starts at step 0 in a workdir with a metrics.jsonl (an earlier attempt killed
  before or during its first periodic checkpoint, resumed from the step-0 checkpoint or
  from scratch): that attempt's records move to metrics.superseded.jsonl, so metrics.jsonl
  is the new run's alone, as after a resume from any other step (s24jax/metrics.py)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    old = f.read()
  if old:
    with open(os.path.join(workdir, "metrics.superseded.jsonl"), "a", encoding="utf-8") as f:
      f.write(old if old.endswith("\n") else old + "\n")
  os.remove(path)
