"""One run per workdir, and the resolved config a run leaves in it.

A run holds `<workdir>/run.lock` (JSON: host, pid, start time; written whole, a temporary file
linked to its name, so a crash or a full disk never leaves half a lock) from before it writes
anything until it ends; a second run on the workdir stops at once naming the holder
(`WorkdirLockedError`), writing nothing. Taken over with a warning: a lock whose process is no
longer alive on this host, and any file there that is not a whole lock of s24jax's (empty,
garbled, `{}`: an older version's crash or a full disk; no live run's lock looks like that).
Never taken over: a lock from another host (its process cannot be checked from here: remove
it by hand if that run is gone) or one this process cannot read; something else named
run.lock (a folder, a link, a pipe) is a `UserError`.

The lock creates the workdir (and its missing parents) if needed, and removes what it created,
if still empty, when released. A workdir that cannot be created or written (a file or a
dangling link in the way, no permission, a read-only filesystem, a full disk) is a
`UserError`, one line naming what is in the way; nothing is left behind.

`write_config` saves the resolved config as `config.json` at the first start; a resumed run
writes `config.resumed_at_<step>.json` only when a field really changed, naming them in it and
in a warning.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import time
import uuid
from typing import Any

from absl import logging
from flax import traverse_util
from ml_collections import config_dict

from s24jax import destinations
from s24jax import errors
from s24jax import metrics as metrics_lib

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
    pass
  return True


def what_is(path: str) -> str:
  """What the existing (or dangling) `path` is, in words, for a message about it."""
  if os.path.islink(path):
    gone = "" if os.path.exists(path) else " (which does not exist)"
    return f"a symbolic link to {os.readlink(path)}{gone}"
  return ("a folder" if os.path.isdir(path) else "a file" if os.path.isfile(path) else
          "a special file (a pipe, socket or device)")


def _is_lock(data: Any) -> bool:
  """Whether `data` (a lock's JSON) is a whole lock as s24jax writes it (`acquire`'s `me`)."""
  pid = data.get("pid") if isinstance(data, dict) else None
  return (isinstance(pid, int) and not isinstance(pid, bool) and pid > 0
          and isinstance(data.get("host"), str))


class WorkdirLock:
  """`with WorkdirLock(workdir):` holds the workdir for this process (reentrant: a second
  acquire by the process that holds it is a no-op, so launch.py and the loop can both ask)."""

  _held: dict[str, int] = {}   # lock path -> nesting depth, in this process

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_NAME)
    self._created: list[str] = []   # the folders acquire() made, deepest first

  def _make_workdir(self) -> None:
    folder = self.workdir
    missing = []
    while not os.path.lexists(folder):
      missing.append(folder)
      folder = os.path.dirname(folder)
    if not os.path.isdir(folder):   # a dangling link (a disk not mounted?): never created here
      head = ("--workdir" if folder == self.workdir else
              f"cannot create the workdir {self.workdir}:")
      fix = "" if os.path.exists(folder) else f"mount or create {os.path.realpath(folder)}, or "
      raise errors.UserError(f"{head} {folder} is {what_is(folder)}, not a folder: {fix}choose "
                             "another --workdir (nothing was written)")
    try:
      os.makedirs(self.workdir, exist_ok=True)
    except OSError as e:
      self._created = [f for f in missing if os.path.isdir(f)]
      self._remove_created()
      raise errors.UserError(f"cannot create the workdir {self.workdir} "
                             f"({destinations.reason(e)}); choose another --workdir") from e
    self._created = missing

  def holder(self) -> dict[str, Any] | None:
    """The lock's content; None without one; {'unreadable': size in bytes, ...} for one that is
    not a whole lock as s24jax writes it (`_is_lock`); pid '?' for one it cannot read."""
    try:
      with open(self.path, "rb") as f:
        raw = f.read()
    except FileNotFoundError:
      return None
    except OSError:   # no permission to read it: another user's, held as far as we can tell
      return {"host": "?", "pid": "?", "started": "?"}
    with contextlib.suppress(ValueError):
      if _is_lock(data := json.loads(raw)):
        return data
    return {"host": "?", "pid": -1, "started": "?", "unreadable": len(raw)}

  def _create(self, me: dict[str, Any]) -> bool:
    """Writes the lock whole, atomically: a temporary file linked to the lock's name (which
    fails if a lock is there), so no other process ever reads half a lock, and a full disk
    leaves none. False if a lock is there."""
    tmp = f"{self.path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    destinations.write_atomic(tmp, json.dumps(me))
    try:
      os.link(tmp, self.path)
      return True
    except FileExistsError:
      return False
    except OSError as e:
      if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
        raise
      # A filesystem without hard links: create-exclusive, then the content.
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        return False
      try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
          json.dump(me, f)
      except BaseException:   # a full disk: no half lock left (it would stop the next run)
        with contextlib.suppress(OSError):
          os.remove(self.path)
        raise
      return True
    finally:
      with contextlib.suppress(OSError):
        os.remove(tmp)

  def _stale(self, other: dict[str, Any], me: dict[str, Any]) -> str | None:
    """Why the lock `other` can be taken over (None: it cannot)."""
    if "unreadable" in other:
      # s24jax writes its lock whole (`_create`): anything less was never a live run's.
      return (f"it is not a lock s24jax writes ({other['unreadable']} bytes; no live run's "
              "lock looks like that)")
    if (other.get("host") == me["host"] and isinstance(other.get("pid"), int)
        and not _alive(other["pid"])):
      return (f"its holder (pid {other.get('pid')} on {other.get('host')}, started "
              f"{other.get('started')}) is no longer running")
    return None

  def acquire(self) -> None:
    if self._held.get(self.path):
      self._held[self.path] += 1
      return
    self._make_workdir()
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for _ in range(3):
      try:
        created = self._create(me)
      except OSError as e:
        self._remove_created()
        if not destinations.is_write_error(e):
          raise
        raise errors.UserError(f"cannot write to the workdir {self.workdir} "
                               f"({destinations.reason(e)}); nothing was written: "
                               f"{destinations.remedy(e)}, or choose another --workdir") from e
      if created:
        self._held[self.path] = 1
        return
      kind = what_is(self.path) if os.path.lexists(self.path) else "a file"
      if kind != "a file":   # a folder, a link, a pipe: neither read nor removed here
        raise errors.UserError(f"{self.path} is {kind}, not a lock s24jax writes: move it out "
                               "of the workdir (nothing was written)")
      other = self.holder()
      if other is None:   # released between the two calls: try again
        continue
      stale = self._stale(other, me)
      if stale:
        logging.warning("taking over %s: %s", self.path, stale)
        with contextlib.suppress(FileNotFoundError):
          os.remove(self.path)
        continue
      self._remove_created()
      raise WorkdirLockedError(
          f"{self.workdir} is in use by another run (pid {other.get('pid')} on "
          f"{other.get('host')}, started {other.get('started')}; lock file {self.path}). "
          "Nothing was written. Wait for it to finish, use another --workdir, or, if that "
          "run is gone (e.g. on another host), remove the lock file.") from None
    self._remove_created()
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
        with contextlib.suppress(FileNotFoundError):
          os.remove(self.path)
      except OSError as e:   # the folder made read-only meanwhile: the run is over anyway
        logging.warning("cannot remove %s (%s): a later run on this host takes it over, "
                        "this process being gone", self.path, destinations.reason(e))
    self._remove_created()

  def _remove_created(self) -> None:
    """The folders acquire() created, if still empty (a stop before the run wrote anything)."""
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
# What a run keeps in its workdir.

# A file where the run keeps a folder, or back, fails a write midway: `check_layout` finds it first.
RUN_FOLDERS = ("checkpoints", "checkpoints_damaged", "tensorboard")
DATA_FINGERPRINT = "data_fingerprint.json"
RUN_FILES = ("config.json", "metrics.jsonl", "metrics.superseded.jsonl", "metrics.jsonl.torn",
             "train.log", "metrics.png", "final_metrics.json", "pending_metrics.json",
             DATA_FINGERPRINT, LOCK_NAME)


def check(workdir: str) -> None:
  """Before a run writes anything (UserError otherwise): the workdir is a folder (or absent),
  each of the run's entries of its kind (`check_layout`), its metrics log readable up to a
  torn last line, and not a workdir of s24jax < 0.3 (the old key `projection` in its
  sparsity block: a train state this version cannot resume)."""
  if os.path.lexists(workdir) and not os.path.isdir(workdir):
    raise errors.UserError(f"--workdir {workdir} is {what_is(workdir)}, not a folder: choose "
                           "another --workdir (nothing was written)")
  check_layout(workdir)
  if os.path.isfile(os.path.join(workdir, "metrics.jsonl")):
    metrics_lib.split_jsonl(os.path.join(workdir, "metrics.jsonl"))
  old = last_config(workdir)
  if old and "projection" in old.get("sparsity", {}):
    raise errors.UserError(
        f"{workdir} was written by s24jax < 0.3: its config.json names the method under the "
        "old key 'projection', now sparsity.method, and its checkpoints hold the old train "
        "state (no method_state). Start a new --workdir, with --config.sparsity.method="
        f"{old['sparsity']['projection']!r}.")


def check_layout(workdir: str) -> None:
  """A UserError if an entry of the workdir is a file where the run keeps a folder, or back."""
  for names, want_dir, kind in ((RUN_FOLDERS, True, "a folder"), (RUN_FILES, False, "a file")):
    for name in names:
      path = os.path.join(workdir, name)
      if os.path.lexists(path) and os.path.isdir(path) != want_dir:
        raise errors.UserError(
            f"{path} is {'a file' if want_dir else 'a folder'}, but the run keeps {kind} "
            "there: move it out of the workdir (nothing was changed)")


def data_history(workdir: str) -> list[dict[str, Any]]:
  """The data the workdir's runs trained on, oldest first: [{'source', 'fingerprint', 'step'}]
  (cache.TokenData's name and fingerprint, the step they were first used at)."""
  try:
    with open(os.path.join(workdir, DATA_FINGERPRINT), encoding="utf-8") as f:
      history = json.load(f)
  except (OSError, ValueError):
    return []
  return [r for r in history if isinstance(r, dict)] if isinstance(history, list) else []


def warn_if_data_changed(workdir: str, data: Any, step: int | None) -> None:
  """A warning if the run resumes (from `step` > 0) on other data (cache.TokenData) than its
  checkpoints were trained on."""
  old = (data_history(workdir) or [{}])[-1]
  if not (step and old and data.fingerprint and data.fingerprint != old.get("fingerprint")):
    return
  source = (f"{old.get('source')} -> {data.name}" if old.get("source") != data.name
            else f"{data.name}, whose tokens changed")
  logging.warning("DATA CHANGED: the run resumes at step %d on other data than its checkpoints "
                  "were trained on (%s; fingerprint %s -> %s, recorded at step %s): its batches "
                  "from here on are not an uninterrupted run's. Restore the data, or start a "
                  "new --workdir to compare cleanly", step, source, old.get("fingerprint"),
                  data.fingerprint, old.get("step"))


def _record_data(workdir: str, data: Any, step: int) -> None:
  """Appends the run's data to DATA_FINGERPRINT when it is new (the first start, a change)."""
  history = data_history(workdir)
  if data.fingerprint and data.fingerprint != (history or [{}])[-1].get("fingerprint"):
    history.append({"source": data.name, "fingerprint": data.fingerprint, "step": step})
    destinations.write_atomic(os.path.join(workdir, DATA_FINGERPRINT),
                              json.dumps(history, indent=1))


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


_RESUMED = re.compile(r"config\.resumed_at_(\d+)\.json")


def last_config_path(workdir: str) -> str | None:
  """The file of the config the workdir's runs last used: the newest
  config.resumed_at_*.json, else config.json; None for a new workdir."""
  names = os.listdir(workdir) if os.path.isdir(workdir) else ()
  resumed = [(int(m[1]), m[0]) for m in map(_RESUMED.fullmatch, names) if m]
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


def write_config(workdir: str, config: config_dict.ConfigDict, step: int,
                 data: Any = None) -> str | None:
  """Saves the resolved config: config.json at the first start (never overwritten); after a
  resume, config.resumed_at_<step>.json only if a field changed ({'changed', 'config'}); and
  the data's fingerprint (`data`: cache.TokenData) when new. Its path written, or None."""
  if data is not None:
    _record_data(workdir, data, step)
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
  destinations.write_atomic(path, json.dumps(payload, indent=2, sort_keys=True))
  return path


def supersede_metrics(workdir: str) -> None:
  """A run that starts at step 0 in a workdir with a metrics.jsonl (an earlier attempt killed
  before or during its first periodic checkpoint): that attempt's records move to
  metrics.superseded.jsonl, so metrics.jsonl is the new run's alone (s24jax/metrics.py)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8", errors="replace") as f:
    old = f.read()
  whole, _, torn = old.rpartition("\n") if not old.endswith("\n") else (old, "", "")
  metrics_lib.set_aside(path, whole.rstrip("\n") + "\n" if whole.strip() else "",
                        torn if torn.strip() else None, None)
