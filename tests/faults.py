"""Faults of the places a command writes, for the write-path tests (tests/cli/test_write_paths.py,
test_destinations.py, test_workdir.py, test_metrics.py, data/test_cache.py, ...): a folder
on a read-only filesystem, a full disk, and the snapshot of a tree (every file's sha256,
every folder) to compare before and after.

Simulated in process, at Python's entry points to the filesystem (os.open / os.mkdir /
os.write / os.sendfile / os.fsync / os.link / os.replace / os.rename / os.unlink / os.remove /
os.rmdir / os.truncate, the built-in open in a writing mode and os.fdopen, whose file objects
write through a file of our own), for paths under the faulty folder only, each doing what the
kernel does there. Read-only (EROFS): every change refused. Full (ENOSPC): as on a disk whose
inodes are not all used, a new file is still created and open(path, "w") still truncates an
existing one (for real: what was there is gone), but its data does not fit: a write fails,
or with `free_bytes` left writes the part that fits first (a short write, as write(2)
returns), and a new folder or an fsync fails. Space a truncated or removed file frees is not
given back (the free bytes only go down), and a file opened before the fault writes as if
there were none (open it under the fault to see its writes fail). Why simulated: the suite
may run as root, whom file modes do not stop (chmod 0o555 changes nothing), and mounting a
real read-only or full filesystem needs privileges CI may not have. What it cannot reach:
writes made in C (tensorstore under Orbax, safetensors' Rust writer, ndarray.tofile): a test
of those patches the library call itself, with the error the library raises on a full disk
(measured on a 64 KiB tmpfs: safetensors' SafetensorError "Error while serializing: I/O
error: No space left on device (os error 28)").
"""
from __future__ import annotations

import builtins
import errno
import hashlib
import io
import os

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def snapshot(root) -> dict[str, str]:
  """{relative path: sha256 of the file, '<dir>', or '<link to T>'} of everything under `root`
  (and root itself: '.'), so an unchanged tree compares equal, byte for byte; a symbolic link
  is recorded by its target (dangling or not), never followed."""
  root = os.fspath(root)
  out = {}
  if not os.path.lexists(root):
    return out
  if os.path.islink(root):
    return {".": f"<link to {os.readlink(root)}>"}
  if not os.path.isdir(root):
    with open(root, "rb") as f:
      return {".": hashlib.sha256(f.read()).hexdigest()}
  for folder, dirs, files in os.walk(root):
    out[os.path.relpath(folder, root)] = "<dir>"
    for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
      path = os.path.join(folder, name)
      if os.path.islink(path):
        out[os.path.relpath(path, root)] = f"<link to {os.readlink(path)}>"
        continue
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    dirs.sort()
  return out


class Faults:
  """`faults.readonly(folder)`, `faults.full(folder, free_bytes=0)` (module docstring); undone
  by the monkeypatch that made it."""

  def __init__(self, monkeypatch):
    self._rules: list[_Rule] = []
    # Undone with the rest: a file opened under the fault writes freely once it is lifted.
    monkeypatch.setattr(self, "_rules", [])
    self._fds: dict[int, tuple[str, int]] = {}                # fd -> (path, inode) opened
    self.hits: list[tuple[str, str]] = []                     # (operation, path) refused
    real = {n: getattr(os, n) for n in ("open", "mkdir", "write", "fsync", "link", "replace",
                                        "rename", "unlink", "remove", "rmdir", "close",
                                        "sendfile", "truncate")}
    real_open = builtins.open

    def rule(op: str, *paths) -> None:
      for path in paths:
        if isinstance(path, int) or path is None:
          continue
        p = os.path.abspath(os.fspath(path))
        for r in self._rules:
          if op in r.ops and r.covers(p):
            self.hits.append((op, p))
            raise OSError(r.code, os.strerror(r.code), p)

    def remember(fd: int, path) -> None:
      self._fds[fd] = (os.path.abspath(os.fspath(path)), os.fstat(fd).st_ino)

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
      if flags & _WRITE_FLAGS:
        rule("create" if flags & os.O_CREAT and not os.path.exists(path) else "change", path)
      fd = real["open"](path, flags, mode, dir_fd=dir_fd)
      if flags & _WRITE_FLAGS:
        remember(fd, path)
      return fd

    def path_of(fd):
      """The path `fd` was opened with here, if it still names that file (a number closed
      elsewhere, e.g. by a file object, and reused is not mistaken for it)."""
      path, inode = self._fds.get(fd, (None, None))
      return path if path is not None and os.fstat(fd).st_ino == inode else None

    def written(path, size: int, write) -> int:
      """`write(n)` (which writes the first n of `size` bytes) for the n the disk takes: all
      of them, or on a full disk with `free_bytes` left the part that fits (a short write),
      else ENOSPC."""
      rule("write", path)   # a read-only folder (a full one has a budget, below)
      budget = next((r for r in self._rules if r.free is not None and r.covers(path)), None)
      if budget is None or size == 0:
        return write(size)
      if budget.free == 0:
        self.hits.append(("write", path))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
      n = write(min(size, budget.free))
      budget.free -= n
      return n

    def os_write(fd, data):
      path = path_of(fd)
      if path is None:
        return real["write"](fd, data)
      data = memoryview(data).cast("B")
      return written(path, len(data), lambda n: real["write"](fd, data[:n]))

    def os_sendfile(out_fd, in_fd, offset, count, *args, **kwargs):
      # shutil.copyfile's fast path: the copy is written to out_fd as os.write would.
      path = path_of(out_fd)
      if path is None:
        return real["sendfile"](out_fd, in_fd, offset, count, *args, **kwargs)
      return written(path, count,
                     lambda n: real["sendfile"](out_fd, in_fd, offset, n, *args, **kwargs))

    def os_fsync(fd):
      rule("fsync", path_of(fd))
      return real["fsync"](fd)

    def os_close(fd):
      self._fds.pop(fd, None)
      return real["close"](fd)

    def two_paths(name):
      def call(src, dst, *args, **kwargs):
        rule("change", src, dst)
        return real[name](src, dst, *args, **kwargs)
      return call

    def one_path(name, op):
      def call(path, *args, **kwargs):
        if op != "mkdir" or not os.path.lexists(path):   # EEXIST comes before ENOSPC
          rule(op, path)
        return real[name](path, *args, **kwargs)
      return call

    class DiskFile(io.FileIO):
      """A file opened for writing under a faulty folder: its writes go through `written`."""

      def write(self, data):
        data = memoryview(data).cast("B")
        return written(self.path, len(data), lambda n: io.FileIO.write(self, data[:n]))

    def open_(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None,
              closefd=True, opener=None):
      if not any(c in mode for c in "wax+"):
        return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
      if isinstance(file, int):   # os.fdopen: the fd os.open opened here
        path = path_of(file)
      else:
        path = os.path.abspath(os.fspath(file))
        rule("create" if not os.path.exists(path) else "change", path)
      if path is None or not any(r.covers(path) for r in self._rules):
        f = real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
        if path is not None:
          remember(f.fileno(), path)
        return f
      # The stack io.open builds, over a raw file whose writes meet the fault: open() itself
      # does what the kernel does (a new file created, an existing one truncated by "w").
      raw = DiskFile(file, mode.replace("b", "").replace("t", ""), closefd, opener)
      raw.path = path
      remember(raw.fileno(), path)
      if buffering == 0:
        return raw
      size = buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE
      buffer = (io.BufferedRandom if "+" in mode else io.BufferedWriter)(raw, size)
      if "b" in mode:
        return buffer
      text = io.TextIOWrapper(buffer, encoding, errors, newline, line_buffering=buffering == 1)
      text.mode = mode
      return text

    patches = {"open": os_open, "write": os_write, "fsync": os_fsync, "close": os_close,
               "sendfile": os_sendfile,
               "link": two_paths("link"), "replace": two_paths("replace"),
               "rename": two_paths("rename"), "mkdir": one_path("mkdir", "mkdir"),
               "unlink": one_path("unlink", "change"), "remove": one_path("remove", "change"),
               "rmdir": one_path("rmdir", "change"), "truncate": one_path("truncate", "change")}
    for name, fn in patches.items():
      monkeypatch.setattr(os, name, fn)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)

  def readonly(self, folder) -> None:
    """Every change under `folder` refused with EROFS (a read-only filesystem)."""
    self._rules.append(_Rule(folder, errno.EROFS,
                             frozenset(("create", "mkdir", "change", "write", "fsync"))))

  def full(self, folder, ops=("mkdir", "write", "fsync"), *, free_bytes: int = 0) -> None:
    """A full disk under `folder`, as the kernel has it: a new file is still created (an inode
    is free) and open(path, "w") still truncates an existing one, but only `free_bytes` more
    bytes can be written there (a write that does not fit writes what does: a short write;
    the next one fails with ENOSPC); a new folder and an fsync fail with ENOSPC.
    `ops=('fsync',)`: only the sync fails, as a delayed allocation fails after the write;
    with 'create' a new file is refused too (no inode free either)."""
    ops = frozenset(ops)
    self._rules.append(_Rule(folder, errno.ENOSPC, ops - {"write"},
                             free_bytes if "write" in ops else None))


class _Rule:
  """The fault of one folder: its errno, the operations refused, and for a full disk the
  bytes still free (None: writes are not limited)."""

  def __init__(self, folder, code: int, ops: frozenset[str], free: int | None = None):
    self.folder = os.path.abspath(os.fspath(folder))
    self.code, self.ops, self.free = code, ops, free

  def covers(self, path: str) -> bool:
    return path == self.folder or path.startswith(self.folder + os.sep)
