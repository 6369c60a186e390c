"""Tests for s24jax/workdir.py: one run per workdir (a lock left by a dead process is taken
over and released; a live holder is refused by name, with the workdir unchanged, byte for
byte) and a workdir written before the method key's rename is refused naming the new key."""
import json
import os
import socket
import subprocess
import sys

import pytest

from s24jax import loop
from s24jax import workdir as workdir_lib

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
