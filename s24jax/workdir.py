"""One run per workdir, and the resolved config a run leaves in it.

A run holds `<workdir>/run.lock` (JSON: host, pid, start time) from before it writes anything
until it ends. A second run on the same workdir stops at once with an error that names the
holder (`WorkdirLockedError`), writing nothing. A lock left by a process that is no longer
alive on this host is taken over with a warning; a lock held from another host is never taken
over (its process cannot be checked from here): remove the file by hand if that run is gone.

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

LOCK_NAME = "run.lock"


class WorkdirLockedError(RuntimeError):
  """Another live run holds the workdir."""


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
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for _ in range(2):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
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

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


# ---------------------------------------------------------------------------------------------
# The resolved config.


def _as_json(config: config_dict.ConfigDict) -> dict[str, Any]:
  return json.loads(config.to_json_best_effort(sort_keys=True))


def changed_fields(old: dict[str, Any], new: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """{dotted field: {'was': old value, 'now': new value}} for every field that differs
  (absent on one side: None)."""
  a = traverse_util.flatten_dict(old, sep=".")
  b = traverse_util.flatten_dict(new, sep=".")
  return {k: {"was": a.get(k), "now": b.get(k)} for k in sorted(set(a) | set(b))
          if a.get(k) != b.get(k)}


def last_config(workdir: str) -> dict[str, Any] | None:
  """The config the workdir's runs last used: the newest config.resumed_at_*.json, else
  config.json; None for a new workdir."""
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
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
      return data.get("config", data) if name != "config.json" else data
  return None


def check_resumable(workdir: str) -> None:
  """A workdir written before 0.3 (the old key `projection` in its sparsity block) holds a
  train state this version cannot resume: say so, naming the new key, before anything is
  read."""
  old = last_config(workdir)
  if old and "projection" in old.get("sparsity", {}):
    raise ValueError(
        f"{workdir} was written by s24jax < 0.3: its config.json names the method under the "
        "old key 'projection', now sparsity.method, and its checkpoints hold the old train "
        "state (no method_state). Start a new --workdir, with --config.sparsity.method="
        f"{old['sparsity']['projection']!r}.")


def write_config(workdir: str, config: config_dict.ConfigDict, step: int) -> str | None:
  """Saves the resolved config: config.json at the first start (never overwritten); after a
  resume, config.resumed_at_<step>.json only if a field changed ({'changed': ..., 'config':
  ...}). Returns the path written, or None."""
  new = _as_json(config)
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
