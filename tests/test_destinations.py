"""Tests for s24jax/destinations.py's one way to write a file (`atomic_file`, `write_atomic`,
`place`, `appending`) and for tests/faults.py's full disk, which behaves as the kernel's does.

The fault first, against what write(2) and open(2) do on a full filesystem (stated by hand:
a new file is created, "w" truncates, a write that does not fit writes what does and returns
that count, the next one fails with ENOSPC, mkdir fails with ENOSPC). Then the writers under
it: the target byte for byte as it was and no temporary file left, whatever fails (a write
cut short, a truncating open's refused write, the sync, an error of the caller's own); the
guard (a user's file of the target's name refused and left byte for byte, this command's own
earlier output replaced). A naive `open(path, "w")` beside them shows what the fault does to
a writer that is not atomic: the test of the writer could fail."""
from __future__ import annotations

import errno
import os

import pytest

from s24jax import destinations

from faults import Faults, snapshot

OURS = "# report of this command\n"


def _ours(path: str) -> bool:
  """The guard of these tests: a file whose first line is OURS's."""
  with open(path, encoding="utf-8") as f:
    return f.readline() == OURS


# ---------------------------------------------------------------------------------------------
# The fault itself.


def test_the_full_disk_creates_truncates_and_writes_part(tmp_path, monkeypatch):
  old = tmp_path / "old.txt"
  old.write_bytes(b"x" * 50)
  faults = Faults(monkeypatch)
  faults.full(tmp_path, free_bytes=6)
  # open(2) needs no data block: a new file is created, an existing one truncated for real.
  fd = os.open(tmp_path / "new.bin", os.O_CREAT | os.O_WRONLY, 0o644)
  assert os.write(fd, b"abcdefgh") == 6          # a short write: the 6 bytes that fit
  with pytest.raises(OSError) as e:
    os.write(fd, b"gh")
  assert e.value.errno == errno.ENOSPC
  os.close(fd)
  assert (tmp_path / "new.bin").read_bytes() == b"abcdef"
  f = open(old, "w", encoding="utf-8")   # pylint: disable=consider-using-with
  assert old.stat().st_size == 0                  # truncated before anything is written
  f.write("new text")
  with pytest.raises(OSError) as e:
    f.close()                                     # the buffer's write meets the full disk
  assert e.value.errno == errno.ENOSPC and old.read_bytes() == b""
  with pytest.raises(OSError) as e:
    os.mkdir(tmp_path / "folder")
  assert e.value.errno == errno.ENOSPC and not (tmp_path / "folder").exists()
  with open(tmp_path / "empty", "wb"):            # a file of no bytes still fits
    pass
  assert (tmp_path / "empty").read_bytes() == b""


def test_a_file_opened_from_an_fd_meets_the_fault_too(tmp_path, monkeypatch):
  Faults(monkeypatch).full(tmp_path, free_bytes=3)
  fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
  with pytest.raises(OSError) as e:
    with os.fdopen(fd, "wb") as f:
      f.write(b"12345")
  assert e.value.errno == errno.ENOSPC and (tmp_path / "f").read_bytes() == b"123"


# ---------------------------------------------------------------------------------------------
# Writing whole or not at all.


@pytest.mark.parametrize("fault", [
    dict(free_bytes=0),                  # nothing fits: the first write fails
    dict(free_bytes=700),                # part fits: a short write, then ENOSPC
    dict(ops=("fsync",)),                # the data fits, the sync fails (delayed allocation)
])
def test_a_full_disk_leaves_the_target_as_it_was(fault, tmp_path, monkeypatch):
  earlier = OURS + "the earlier report\n"
  target, naive = tmp_path / "report.md", tmp_path / "naive.md"
  target.write_text(earlier, encoding="utf-8")
  naive.write_text(earlier, encoding="utf-8")

  def write_lines(f):
    for i in range(100):                 # streamed: 1,500 bytes in 100 writes
      f.write(f"line {i:4d} ....\n")

  before = snapshot(tmp_path)
  with monkeypatch.context() as m:
    Faults(m).full(tmp_path, **fault)
    with pytest.raises(OSError) as e:
      with destinations.atomic_file(target, "w", replaces=_ours) as f:
        write_lines(f)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)   # not the temporary
    if "free_bytes" in fault:            # the same writes in place: the open truncated it
      with pytest.raises(OSError):
        with open(naive, "w", encoding="utf-8") as f:
          write_lines(f)
  if "free_bytes" in fault:
    assert naive.read_bytes() == b""     # the earlier text gone (the atomic write took the
    naive.write_text(earlier, encoding="utf-8")   # free bytes): what the fault can do
  assert snapshot(tmp_path) == before    # byte for byte, and no temporary file


def test_a_caller_error_inside_the_block_leaves_the_target(tmp_path):
  target = tmp_path / "cache.bin"
  target.write_bytes(b"good")
  with pytest.raises(ZeroDivisionError):
    with destinations.atomic_file(target) as f:
      f.write(b"half")
      raise ZeroDivisionError
  assert os.listdir(tmp_path) == ["cache.bin"] and target.read_bytes() == b"good"


def test_a_write_replaces_the_target_whole_and_syncs_it(tmp_path, monkeypatch):
  target = tmp_path / "sub" / "table.md"
  target.parent.mkdir()
  synced = []
  real_fsync = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or
                      real_fsync(fd))
  destinations.write_atomic(target, "naïve café\n")
  assert target.read_bytes() == "naïve café\n".encode("utf-8")
  # The file (the inode that now holds the name) and its folder, each synced.
  assert synced == [target.stat().st_ino, target.parent.stat().st_ino]
  destinations.write_atomic(str(target), b"\x00\xff")
  assert target.read_bytes() == b"\x00\xff" and os.listdir(target.parent) == ["table.md"]
  missing = tmp_path / "missing" / "table.md"      # a folder the checks accept as makeable
  destinations.write_atomic(missing, "x")
  assert missing.read_text() == "x" and os.listdir(missing.parent) == ["table.md"]
  blocked = tmp_path / "a_file" / "table.md"       # a file where its folder would go
  (tmp_path / "a_file").write_text("mine")
  with pytest.raises(OSError):
    destinations.write_atomic(blocked, "x")
  assert (tmp_path / "a_file").read_text() == "mine"
  with pytest.raises(ValueError, match="mode 'a'; valid: 'w', 'wb'"):
    with destinations.atomic_file(target, "a"):
      pass


def test_a_read_only_folder_changes_nothing(tmp_path, monkeypatch):
  (tmp_path / "report.md").write_text(OURS)
  before = snapshot(tmp_path)
  with monkeypatch.context() as m:
    Faults(m).readonly(tmp_path)
    with pytest.raises(OSError) as e:
      destinations.write_atomic(tmp_path / "report.md", OURS + "new\n")
  assert e.value.errno == errno.EROFS and snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# The guard: a command replaces only its own earlier output.


def test_the_guard_refuses_a_users_file_and_replaces_our_own(tmp_path):
  mine = tmp_path / "mine.md"
  mine.write_bytes(b"# my notes\n\xff binary tail")
  folder = tmp_path / "a_folder.md"
  folder.mkdir()
  before = snapshot(tmp_path)
  for path, says in ((mine, f"{mine} exists and is not an earlier report: it is left as it "
                            "is"),
                     (folder, f"{folder} is a folder, not an earlier report")):
    with pytest.raises(destinations.DestinationError) as e:
      destinations.write_atomic(path, OURS + "new\n", replaces=_ours_or_false,
                                what="an earlier report")
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert e.value.exit_code == 2
  assert snapshot(tmp_path) == before           # byte for byte, nothing beside them
  with pytest.raises(IsADirectoryError):        # no guard: the OSError, nothing written
    destinations.write_atomic(folder, "x")
  assert snapshot(tmp_path) == before

  ours = tmp_path / "report.md"
  ours.write_text(OURS + "the earlier one\n", encoding="utf-8")
  destinations.write_atomic(ours, OURS + "the new one\n", replaces=_ours_or_false)
  assert ours.read_text(encoding="utf-8") == OURS + "the new one\n"
  fresh = tmp_path / "fresh.md"                 # no file yet: nothing to guard
  destinations.write_atomic(fresh, OURS, replaces=_ours_or_false)
  assert fresh.read_text(encoding="utf-8") == OURS


def _ours_or_false(path: str) -> bool:
  try:
    return _ours(path)
  except (OSError, UnicodeDecodeError):
    return False


# ---------------------------------------------------------------------------------------------
# place() and appending().


def test_place_moves_a_finished_file_over_the_target(tmp_path):
  src, target = tmp_path / "download.part", tmp_path / "wheel.whl"
  src.write_bytes(b"new wheel")
  target.write_bytes(b"old wheel")
  destinations.place(src, target)
  assert target.read_bytes() == b"new wheel" and os.listdir(tmp_path) == ["wheel.whl"]


def test_a_failed_append_is_cut_back_and_a_new_file_removed(tmp_path, monkeypatch):
  log, new = tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl.torn"
  log.write_text('{"step": 1}\n')
  before = snapshot(tmp_path)
  with monkeypatch.context() as m:
    Faults(m).full(tmp_path, free_bytes=30)
    with pytest.raises(OSError) as e:
      with destinations.appending(log, new):
        with open(new, "a", encoding="utf-8") as f:
          f.write('{"step": 2, "torn')             # 17 bytes: fits
        try:
          with open(log, "a", encoding="utf-8") as f:
            f.write('{"step": 2, "train/loss": 1.5}\n')   # 13 of its 31 bytes fit
        except OSError:
          cut_short = log.read_text()
          raise
    assert e.value.errno == errno.ENOSPC
  assert cut_short == '{"step": 1}\n{"step": 2, "'   # the short write, by hand
  assert snapshot(tmp_path) == before           # the log as it was, the new file gone
  with destinations.appending(log):             # no error: the append stays
    with open(log, "a", encoding="utf-8") as f:
      f.write('{"step": 2}\n')
  assert log.read_text() == '{"step": 1}\n{"step": 2}\n'
