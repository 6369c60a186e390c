"""Where a command writes: every destination checked before any work, every failed write one line.

The rule every command follows (launch.py and the loop, `python -m s24jax.cli.evaluate`, `.export`,
`.plan`, the token cache): before the work starts, each place it will write is checked
(`check_folder`, `check_file`, `check_apart`): a folder that exists or can be created, that this
process can write (a small file created and removed there: it finds a read-only filesystem, a
missing permission, a full disk), with the free space the output needs, a file where a file
belongs and a folder where a folder does, and for an export never the run it reads (the
workdir, or a folder holding it). A problem found there is a `DestinationError` (a UserError,
exit code 2) naming the path and what to do, and nothing was written.

A write that fails after the checks (the disk filled up during the work, a folder removed or
made read-only meanwhile) is a `WriteError` (exit code 5, errors.EXIT_STORAGE), one line: what
could not be written, why (`reason`), and what is intact.

Every file the project writes is written one way: whole or not at all (`atomic_file`, a
stream, and `write_atomic`, bytes or text: a temporary file in the same folder, synced,
renamed over the target, the folder synced; `place` for a file another program wrote), so a
failed write (a full disk, a crash, a power cut) never leaves half a file where a good one
was, nor a temporary file; no file that matters is opened with "w", which truncates it before
a write can fail. A command replaces only its own earlier output (`replaces`, the guard
`check_file` has too: an existing file is recognised by its content), never a user's file of
the same name. A log appended to (`appending`) is cut back to its length before a failed
append. Orbax writes its checkpoints itself (a temporary folder renamed when complete).

This module imports nothing of s24jax but errors.py (every layer may use it).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from typing import IO, Callable, Iterator

from s24jax import errors

# The errors a write meets that are about the place, not the program: each is one line.
WRITE_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM,
                          errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENOENT})
_REASONS = {
    errno.EROFS: "the filesystem is read-only",
    errno.ENOSPC: "no space left on the device: the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EISDIR: "it is a folder, not a file",
    errno.EEXIST: "something else is already there",
    errno.ENOENT: "a folder on the way does not exist (removed meanwhile?)",
}


class DestinationError(errors.UserError):
  """A place the command would write cannot be written or must not be: found before any
  work, nothing written."""


class WriteError(errors.KnownError):
  """A write failed after the checks; the message says what is intact."""
  exit_code = errors.EXIT_STORAGE


# Errors only a write meets (a read or a missing input never gives these).
_WRITE_ONLY = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT})


def is_write_error(e: BaseException, under: str | None = None) -> bool:
  """Whether `e` is a write error of WRITE_ERRNOS; with `under` (a folder the command writes
  in), one of the others counts only for a file there (a read elsewhere may fail alike)."""
  if not isinstance(e, OSError) or e.errno not in WRITE_ERRNOS:
    return False
  if under is None or e.errno in _WRITE_ONLY:
    return True
  return bool(e.filename) and inside(os.fspath(e.filename), under)


def file_in_the_way(path: str) -> str | None:
  """The first part of `path`, from the root, that exists and is not a folder (None if none
  is; the last part itself is not looked at)."""
  parts = os.path.abspath(path).split(os.sep)
  for i in range(2, len(parts)):
    head = os.sep.join(parts[:i])
    if os.path.lexists(head) and not os.path.isdir(head):
      return head
  return None


def reason(e: OSError) -> str:
  """Why the write failed, in words (the errno's, with the file in the way of ENOTDIR)."""
  if e.errno == errno.ENOTDIR and e.filename:
    blocker = file_in_the_way(os.fspath(e.filename) + os.sep + "x")
    if blocker:
      return f"{blocker} is a file, not a folder"
  return _REASONS.get(e.errno, e.strerror or str(e))


def remedy(e: OSError) -> str:
  """What to do about a failed write, in a few words."""
  return ("free space there" if e.errno in (errno.ENOSPC, errno.EDQUOT) else
          "move the file in the way" if e.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR)
          else "make it writable")


def write_failed(e: OSError, what: str, intact: str,
                 error: type[errors.KnownError] = WriteError) -> errors.KnownError:
  """The one-line WriteError (or `error`) of a failed write of `what` (a path or words)."""
  where = f" ({e.filename})" if e.filename and os.fspath(e.filename) not in what else ""
  return error(f"cannot write {what}{where}: {reason(e)}. {intact}")


@contextlib.contextmanager
def writing(what: str, intact: str, under: str | None = None,
            error: type[errors.KnownError] = WriteError) -> Iterator[None]:
  """Turns a write error inside (`is_write_error`, for files `under` the folder written in)
  into `write_failed`'s one line (`error`: DestinationError for a write before the work); any
  other error is left as it is (a bug keeps its traceback)."""
  try:
    yield
  except errors.KnownError:
    raise
  except OSError as e:
    if not is_write_error(e, under):
      raise
    raise write_failed(e, what, intact, error) from e


# ---------------------------------------------------------------------------------------------
# The checks before any work.


def _nearest_existing(path: str) -> str:
  path = os.path.abspath(path)
  while not os.path.lexists(path):
    path = os.path.dirname(path)
  return path


def probe(folder: str) -> None:
  """Creates a small file in the existing `folder` and removes it: the OSError of a folder this
  process cannot write (a read-only filesystem, no permission, no space left)."""
  path = os.path.join(folder, f".s24jax-write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
  try:
    os.write(fd, b"\0" * 4096)   # one block: a full disk refuses it
  finally:
    os.close(fd)
    with contextlib.suppress(OSError):
      os.unlink(path)


def check_folder(path: str, *, what: str, flag: str, need_bytes: int = 0) -> None:
  """`path` is a folder this process can write (or can be created as one), with `need_bytes`
  free: else DestinationError naming `what` (e.g. 'the export') and `flag` (what to change).
  Nothing is left behind."""
  path = os.path.abspath(path)
  blocker = file_in_the_way(os.path.join(path, "x"))
  if blocker:
    raise DestinationError(f"cannot write {what} in {path}: {blocker} is a file, not a folder; "
                           f"choose another {flag} (nothing was written)")
  folder = _nearest_existing(path)
  try:
    probe(folder)
  except OSError as e:
    if not is_write_error(e):
      raise
    at = f" ({folder})" if folder != path else ""
    raise DestinationError(f"cannot write {what} in {path}: {reason(e)}{at}; choose another "
                           f"{flag} (nothing was written)") from e
  free = shutil.disk_usage(folder).free
  if need_bytes and free < need_bytes:
    raise DestinationError(f"cannot write {what} in {path}: {_size(free)} free there, "
                           f"{what} needs about {_size(need_bytes)}; free space or choose "
                           f"another {flag} (nothing was written)")


def check_file(path: str, *, what: str, flag: str,
               replaces: Callable[[str], bool] | None = None) -> None:
  """`path` is a file this process can write: not a folder, its folder writable
  (`check_folder`); an existing file only if `replaces(path)` says it is one of ours
  (e.g. an earlier report), so no other file is ever overwritten."""
  path = os.path.abspath(path)
  if os.path.isdir(path):
    raise DestinationError(f"{flag} {path} is a folder, not {what}: it is left as it is; "
                           f"choose another {flag} or move it away (nothing was written)")
  if os.path.lexists(path) and replaces is not None and not replaces(path):
    raise DestinationError(f"{flag} {path} exists and is not {what}: it is left as it is; "
                           f"choose another {flag} or move it away (nothing was written)")
  check_folder(os.path.dirname(path), what=what, flag=flag)


def inside(path: str, folder: str) -> bool:
  """Whether `path` is `folder` or under it (symbolic links resolved)."""
  path, folder = os.path.realpath(path), os.path.realpath(folder)
  return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_apart(out: str, source: str, *, flag: str, keep: tuple[str, ...] = ()) -> None:
  """`out` (a folder a command replaces) is neither `source` nor a folder holding it, nor one
  of `keep` (the source's own entries, e.g. its checkpoints) or inside one."""
  if inside(source, out):
    which = "is" if os.path.realpath(out) == os.path.realpath(source) else "holds"
    raise DestinationError(f"{flag} {out} {which} the run's workdir {source}: writing there "
                           f"would replace the run; choose a new folder, e.g. {flag} "
                           f"{os.path.join(source, 'hf')} (nothing was written)")
  for name in keep:
    if inside(out, os.path.join(source, name)):
      raise DestinationError(f"{flag} {out} is inside the run's {name}/ folder; choose a new "
                             f"folder, e.g. {flag} {os.path.join(source, 'hf')} (nothing "
                             "was written)")


def json_with_keys(*keys: str) -> Callable[[str], bool]:
  """A `replaces` test for check_file: the file is a JSON object holding `keys` (a report
  this command wrote)."""
  def test(path: str) -> bool:
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
    except (OSError, ValueError):
      return False
    return isinstance(data, dict) and all(k in data for k in keys)
  return test


# ---------------------------------------------------------------------------------------------
# Writing.


def _guard(path: str, replaces: Callable[[str], bool] | None, what: str) -> None:
  """An existing `path` that `replaces` does not recognise as this command's own output: a
  DestinationError, the file left as it is. A folder there: refused too (IsADirectoryError
  without a guard)."""
  if os.path.isdir(path):
    if replaces is None:
      raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    raise DestinationError(f"{path} is a folder, not {what}: it is left as it is; choose "
                           "another name or move it away (nothing was written)")
  if replaces is not None and os.path.lexists(path) and not replaces(path):
    raise DestinationError(f"{path} exists and is not {what}: it is left as it is; choose "
                           "another name or move it away (nothing was written)")


def _sync_folder(folder: str) -> None:
  """The folder's entries to the disk, so a rename survives a power cut. A filesystem that
  cannot sync a folder (some network ones) is let be: the file itself is synced, and the name
  then holds the old file or the new one, each whole."""
  with contextlib.suppress(OSError):
    fd = os.open(folder, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", *,
                replaces: Callable[[str], bool] | None = None,
                what: str = "this command's output") -> Iterator[IO]:
  """`with atomic_file(path) as f: f.write(...)`: `path` written whole or not at all. `f` is a
  temporary file beside `path` (mode 'wb', or 'w': UTF-8 text); when the block ends it is
  flushed, synced, renamed over `path` and the folder synced; if the block (or any of that)
  raises, the temporary file is removed and `path` is as it was. `replaces` (the guard, as
  check_file has it): an existing `path` it does not recognise as `what` (this command's
  earlier output) is left alone and a DestinationError raised, before anything is written.
  A missing folder is made (the checks before the work accept one that can be: check_folder).
  OSError on a failed write."""
  if mode not in ("w", "wb"):
    raise ValueError(f"atomic_file: mode {mode!r}; valid: 'w', 'wb'")
  path = os.path.abspath(os.fspath(path))
  _guard(path, replaces, what)
  folder, name = os.path.split(path)
  os.makedirs(folder, exist_ok=True)
  tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  f = None
  try:
    f = open(tmp, mode.replace("w", "x"), **({"encoding": "utf-8"} if mode == "w" else {}))
    yield f
    f.flush()
    os.fsync(f.fileno())
    f.close()
    os.replace(tmp, path)
  except BaseException as e:
    if f is not None:
      with contextlib.suppress(OSError):
        f.close()   # its buffer may not fit either: the first error is the one raised
      with contextlib.suppress(OSError):
        os.unlink(tmp)
    if isinstance(e, OSError) and e.filename == tmp:
      e.filename = path   # the file the caller writes (the temporary one is not there)
    raise
  _sync_folder(folder)


def place(src: str | os.PathLike, path: str | os.PathLike) -> None:
  """A file another program wrote whole (pip's download) synced and renamed over `path`, the
  folder synced: atomic_file's last step, for `src` in `path`'s filesystem."""
  fd = os.open(src, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
  os.replace(src, path)
  _sync_folder(os.path.dirname(os.path.abspath(path)))


def write_atomic(path: str | os.PathLike, data: str | bytes, *,
                 replaces: Callable[[str], bool] | None = None,
                 what: str = "this command's output") -> None:
  """`data` written to `path` whole or not at all (`atomic_file`, its guard included)."""
  with atomic_file(path, "w" if isinstance(data, str) else "wb", replaces=replaces,
                   what=what) as f:
    f.write(data)


@contextlib.contextmanager
def appending(*paths: str | os.PathLike) -> Iterator[None]:
  """Appends to `paths` inside the block are undone if it raises: each file is cut back to
  the length it had (one that did not exist is removed), so a full disk never leaves part of
  a record, nor records a retry would append again. Cutting back needs no space."""
  sizes = {}
  for p in map(os.fspath, paths):
    sizes[p] = os.path.getsize(p) if os.path.lexists(p) else None
  try:
    yield
  except BaseException:
    for p, size in sizes.items():
      with contextlib.suppress(OSError):
        if size is None:
          os.unlink(p)
        else:
          os.truncate(p, size)
    raise


def _size(n: float) -> str:
  return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"
