"""Faults of the places a command writes, for the write-path tests (tests/test_write_paths.py,
test_workdir.py, test_metrics.py): a folder on a read-only filesystem, a full disk, and the
snapshot of a tree (every file's sha256, every folder) to compare before and after.

Simulated in process, at Python's entry points to the filesystem (os.open / os.mkdir /
os.write / os.fsync / os.link / os.replace / os.rename / os.unlink / os.remove / os.rmdir and
the built-in open in a writing mode), for paths under the faulty folder only, each raising the
OSError the kernel gives there (EROFS: every change refused; ENOSPC: a new file, a new folder or a write
refused). Why simulated: the suite may run as root, whom file modes do not stop (chmod 0o555
changes nothing), and mounting a real read-only or full filesystem needs privileges CI may not
have. What it cannot reach: writes made in C (tensorstore under Orbax, safetensors' Rust
writer): a test of those patches the library call itself, with the error the library raises
on a full disk (measured on a 64 KiB tmpfs: safetensors' SafetensorError "Error while
serializing: I/O error: No space left on device (os error 28)").
"""
from __future__ import annotations

import builtins
import errno
import hashlib
import io
import os

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def snapshot(root) -> dict[str, str]:
  """{relative path: sha256 of the file, or '<dir>'} of everything under `root` (and root
  itself: '.'), so an unchanged tree compares equal, byte for byte."""
  root = os.fspath(root)
  out = {}
  if not os.path.lexists(root):
    return out
  if not os.path.isdir(root):
    with open(root, "rb") as f:
      return {".": hashlib.sha256(f.read()).hexdigest()}
  for folder, dirs, files in os.walk(root):
    out[os.path.relpath(folder, root)] = "<dir>"
    for name in files:
      path = os.path.join(folder, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    dirs.sort()
  return out


class Faults:
  """`faults.readonly(folder)`, `faults.full(folder)` (module docstring); undone by the
  monkeypatch that made it."""

  def __init__(self, monkeypatch):
    self._rules: list[tuple[str, int, frozenset[str]]] = []   # (folder, errno, operations)
    self._fds: dict[int, tuple[str, int]] = {}                # fd -> (path, inode) opened
    self.hits: list[tuple[str, str]] = []                     # (operation, path) refused
    real = {n: getattr(os, n) for n in ("open", "mkdir", "write", "fsync", "link", "replace",
                                        "rename", "unlink", "remove", "rmdir", "close")}
    real_open = builtins.open

    def rule(op: str, *paths) -> None:
      for path in paths:
        if isinstance(path, int) or path is None:
          continue
        p = os.path.abspath(os.fspath(path))
        for folder, code, ops in self._rules:
          if op in ops and (p == folder or p.startswith(folder + os.sep)):
            self.hits.append((op, p))
            raise OSError(code, os.strerror(code), p)

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
      if flags & _WRITE_FLAGS:
        rule("create" if flags & os.O_CREAT and not os.path.exists(path) else "change", path)
      fd = real["open"](path, flags, mode, dir_fd=dir_fd)
      if flags & _WRITE_FLAGS:
        self._fds[fd] = (os.path.abspath(os.fspath(path)), os.fstat(fd).st_ino)
      return fd

    def path_of(fd):
      """The path `fd` was opened with here, if it still names that file (a number closed
      elsewhere, e.g. by a file object, and reused is not mistaken for it)."""
      path, inode = self._fds.get(fd, (None, None))
      return path if path is not None and os.fstat(fd).st_ino == inode else None

    def os_write(fd, data):
      rule("write", path_of(fd))
      return real["write"](fd, data)

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
        rule(op, path)
        return real[name](path, *args, **kwargs)
      return call

    def open_(file, mode="r", *args, **kwargs):
      if not isinstance(file, int) and any(c in mode for c in "wax+"):
        rule("create" if not os.path.exists(file) else "change", file)
        rule("write", file)
      return real_open(file, mode, *args, **kwargs)

    patches = {"open": os_open, "write": os_write, "fsync": os_fsync, "close": os_close,
               "link": two_paths("link"), "replace": two_paths("replace"),
               "rename": two_paths("rename"), "mkdir": one_path("mkdir", "create"),
               "unlink": one_path("unlink", "change"), "remove": one_path("remove", "change"),
               "rmdir": one_path("rmdir", "change")}
    for name, fn in patches.items():
      monkeypatch.setattr(os, name, fn)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)

  def readonly(self, folder) -> None:
    """Every change under `folder` refused with EROFS (a read-only filesystem)."""
    self._add(folder, errno.EROFS, ("create", "change", "write", "fsync"))

  def full(self, folder, ops=("create", "write", "fsync")) -> None:
    """A full disk under `folder`: a new file or folder, a write, a sync refused with ENOSPC
    (`ops=('fsync',)`: only the sync, as a delayed allocation fails after the write)."""
    self._add(folder, errno.ENOSPC, ops)

  def _add(self, folder, code: int, ops) -> None:
    self._rules.append((os.path.abspath(os.fspath(folder)), code, frozenset(ops)))
