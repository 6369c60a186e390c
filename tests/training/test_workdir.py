"""Tests for s24jax/training/workdir.py: one run per workdir (a lock left by a dead process is taken
over and released, and so is an empty or garbled one, or JSON that is not a whole lock; a
run.lock that is a folder or a link is refused, one line, and left as it is; one this process
cannot read is held; a live holder is refused by name, with the workdir unchanged, byte for
byte; a full or read-only disk is one line and leaves no lock, not even part of one where the
filesystem has no hard links) and a workdir written before the method key's rename is refused
naming the new key."""
import errno
import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from s24jax import errors
from s24jax.training import loop
from s24jax.training import workdir as workdir_lib

from faults import Faults, snapshot
from train_helpers import digest, run_config


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, data_cache):
  workdir = str(tmp_path / "stale")
  os.makedirs(workdir)
  path = os.path.join(workdir, workdir_lib.LOCK_NAME)
  dead = subprocess.Popen([sys.executable, "-c", "pass"])   # a pid that is surely gone
  dead.wait()
  with open(path, "w") as f:
    json.dump({"host": socket.gethostname(), "pid": dead.pid, "started": "earlier"}, f)
  with workdir_lib.WorkdirLock(workdir):
    with open(path) as f:
      assert json.load(f)["pid"] == os.getpid()   # taken over
  assert not os.path.exists(path)                 # and released
  # A live holder (this process's parent, seen as another run) is refused with its name,
  # by the loop, before it writes anything.
  with open(path, "w") as f:
    json.dump({"host": socket.gethostname(), "pid": os.getppid(), "started": "now"}, f)
  before = digest(workdir)
  with pytest.raises(workdir_lib.WorkdirLockedError, match=f"pid {os.getppid()}"):
    loop.train_and_evaluate(run_config(data_cache, steps=4), workdir)
  assert digest(workdir) == before


def test_a_workdir_from_before_the_rename_is_refused_with_the_new_key(tmp_path, data_cache):
  workdir = str(tmp_path / "old")
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"sparsity": {"projection": "s_ste"}}, f)
  with pytest.raises(ValueError, match="sparsity.method"):
    loop.train_and_evaluate(run_config(data_cache, steps=2), workdir)


def test_an_empty_or_unreadable_lock_is_taken_over(tmp_path, caplog):
  """What a crash or a full disk left while an older version wrote its lock, or any JSON
  that is not a whole lock (a host and a pid > 0; `{}` used to block the workdir until
  removed by hand): no live run's lock looks like that (it is written whole), so it is
  taken over with a warning."""
  path = tmp_path / workdir_lib.LOCK_NAME
  for content in (b"", b'{"host": "x", "pi', b"\x00" * 64, b"{}", b"[]", b'"run"',
                  b'{"host": "x"}', b'{"pid": 12}', b'{"host": "x", "pid": 0}',
                  b'{"host": "x", "pid": true}', b'{"host": 3, "pid": 12}'):
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
      with workdir_lib.WorkdirLock(str(tmp_path)):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert f"not a lock s24jax writes ({len(content)} bytes" in caplog.text
    assert not path.exists()
    caplog.clear()


def test_a_run_lock_that_is_not_a_file_is_neither_read_nor_removed(tmp_path):
  """A folder named run.lock (it was a traceback: os.remove on a folder) and a link (here to
  another host's live lock, which a take-over must not follow) are a user's, not a lock
  s24jax writes: one line naming what it is, everything left as it was."""
  other = tmp_path / "other.lock"
  other.write_text(json.dumps({"host": "elsewhere", "pid": 7, "started": "now"}))
  cases = (("folder", "is a folder", lambda p: (p.mkdir(), (p / "notes.txt").write_text("x"))),
           ("link", f"is a symbolic link to {other},", lambda p: os.symlink(other, p)),
           ("dangling", f"is a symbolic link to {tmp_path / 'gone'} (which does not exist),",
            lambda p: os.symlink(tmp_path / "gone", p)))
  for name, says, make in cases:
    workdir = tmp_path / name
    workdir.mkdir()
    make(workdir / workdir_lib.LOCK_NAME)
    before = {p: (os.path.islink(p), os.path.lexists(p)) for p in workdir.rglob("*")}
    before_all = snapshot(other)
    with pytest.raises(errors.UserError) as e:
      workdir_lib.WorkdirLock(str(workdir)).acquire()
    assert says in str(e.value) and "not a lock s24jax writes" in str(e.value), str(e.value)
    assert str(workdir / workdir_lib.LOCK_NAME) in str(e.value) and "\n" not in str(e.value)
    assert {p: (os.path.islink(p), os.path.lexists(p)) for p in workdir.rglob("*")} == before
    assert snapshot(other) == before_all


def test_a_lock_this_process_cannot_read_is_held(tmp_path, monkeypatch):
  """No permission to read the lock (another user's run): it is not taken over (it used to
  be, as unreadable); the run stops with exit code 3 and the lock stays. Simulated (the suite
  may run as root, whom file modes do not stop) at the read of the lock, as the kernel
  refuses it."""
  lock = tmp_path / workdir_lib.LOCK_NAME
  lock.write_text(json.dumps({"host": "x", "pid": 7, "started": "now"}))
  real_open = open

  def no_permission(path, *args, **kwargs):
    if os.fspath(path) == str(lock):
      raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(lock))
    return real_open(path, *args, **kwargs)

  before = snapshot(tmp_path)
  monkeypatch.setattr("builtins.open", no_permission)
  with pytest.raises(workdir_lib.WorkdirLockedError, match="is in use by another run"):
    workdir_lib.WorkdirLock(str(tmp_path)).acquire()
  monkeypatch.undo()
  assert snapshot(tmp_path) == before


@pytest.mark.parametrize("fault", ["full", "readonly"])
def test_a_workdir_on_a_full_or_read_only_disk_is_one_line_and_leaves_no_lock(
    fault, tmp_path, monkeypatch):
  """The issue's case: the lock could not be written. One line, no lock (not even an empty
  one), no workdir created, the folder as it was; once the disk is fixed the lock is free."""
  existing = tmp_path / "existing"
  existing.mkdir()
  (existing / "config.json").write_text("{}")
  before = snapshot(tmp_path)
  says = {"full": "no space left on the device", "readonly": "the filesystem is read-only"}
  with monkeypatch.context() as m:
    getattr(Faults(m), fault)(tmp_path)
    for workdir in (existing, tmp_path / "new" / "w"):
      with pytest.raises(errors.UserError) as e:
        workdir_lib.WorkdirLock(str(workdir)).acquire()
      assert says[fault] in str(e.value) and str(workdir) in str(e.value), str(e.value)
      assert "\n" not in str(e.value)
  assert snapshot(tmp_path) == before
  with workdir_lib.WorkdirLock(str(existing)):   # space freed: the workdir is free
    assert (existing / workdir_lib.LOCK_NAME).exists()


def test_a_full_disk_without_hard_links_leaves_no_part_of_a_lock(tmp_path, monkeypatch):
  """Where os.link is not supported the lock is created exclusively, then written: a disk
  that fills in that write (the temporary copy fits, 10 bytes of the lock do) leaves none."""
  lock = {"host": socket.gethostname(), "pid": os.getpid(), "started": "2024-01-01T00:00:00+0000"}
  before = snapshot(tmp_path)
  with monkeypatch.context() as m:
    Faults(m).full(tmp_path, ops=("write",), free_bytes=len(json.dumps(lock)) + 10)

    def no_hard_links(src, dst):
      raise OSError(errno.EPERM, os.strerror(errno.EPERM), src)
    m.setattr(os, "link", no_hard_links)
    with pytest.raises(errors.UserError, match="no space left on the device") as e:
      workdir_lib.WorkdirLock(str(tmp_path)).acquire()
  assert "\n" not in str(e.value) and snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes (the simulated "
                    "faults above stand for it)")
def test_a_workdir_without_write_permission(tmp_path):
  existing = tmp_path / "w"
  existing.mkdir()
  os.chmod(existing, 0o555)
  try:
    with pytest.raises(errors.UserError, match="permission denied"):
      workdir_lib.WorkdirLock(str(existing)).acquire()
    assert os.listdir(existing) == []
  finally:
    os.chmod(existing, 0o755)
