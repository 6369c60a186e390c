"""A second, held-out corpus for the comparisons: the Python standard library's source.

  python experiments/pystdlib_corpus.py DIR      # writes DIR/<module path>.txt, one per module

Offline on every machine with Python: the .py files of this interpreter's standard library
(CPython 3.11 here: 562 modules, 10.6 MB of code with English docstrings and comments), minus
the test suites, IDLE, tkinter, lib2to3, turtledemo, ensurepip and site-packages, one
document per module. Then train on it with `--config.data.path=DIR` (the text-folder TFDS
builder splits it by document). Chosen because it differs from Shakespeare in every way that
matters to a language model, and no hyper-parameter of this project was tuned on it.

The folder is written whole or not at all: into a temporary folder beside DIR, renamed to DIR
when complete, its PYTHON_VERSION file last. A DIR written for this Python is used as it is;
one written for another Python is replaced; any other DIR that holds files (a user's folder)
is left as it is and the script stops (exit code 2), as it does for a DIR it cannot write.
A full disk: one line, exit code 5, nothing left behind. Ctrl-C: exit code 75, nothing left.
"""
from __future__ import annotations

from s24jax.cli import command

NAME = "experiments/pystdlib_corpus.py"
if __name__ == "__main__":
  command.guard_startup(NAME)

# pylint: disable=wrong-import-position  (after the guard: Ctrl-C during imports is one line)
import os
import pathlib
import shutil
import sys
import sysconfig
import uuid

from s24jax import destinations
from s24jax import errors
from s24jax.cli import args

SKIP = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "tkinter",
        "ensurepip", "__pycache__"}
MARKER = "PYTHON_VERSION"
SIZE_BYTES = 16 * 2**20   # about 11 MB of source (module docstring), with room


def modules() -> list[pathlib.Path]:
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return [p for p in sorted(root.rglob("*.py"))
          if not set(p.relative_to(root).parts[:-1]) & SKIP
          and not p.relative_to(root).parts[0].startswith("config-")]


def _version_in(folder: str) -> str | None:
  """The Python version of the corpus in `folder` (its marker); None if it has none."""
  try:
    with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
      return f.read()
  except (FileNotFoundError, NotADirectoryError, IsADirectoryError, UnicodeDecodeError):
    return None


def _write(folder: str, version: str) -> None:
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  for src in modules():
    name = str(src.relative_to(root)).replace("/", "__") + ".txt"
    destinations.write_atomic(os.path.join(folder, name),
                              src.read_text(encoding="utf-8", errors="replace"))
  destinations.write_atomic(os.path.join(folder, MARKER), version)


def prepare(directory: str) -> str:
  """Writes the corpus once (module docstring); returns the folder."""
  out = os.path.abspath(directory)
  version = sys.version.split()[0]
  found = _version_in(out)
  if found == version:
    return out
  if os.path.lexists(out) and not os.path.isdir(out):
    raise errors.UserError(f"{out} is a file, not a folder: the corpus cannot go there; "
                           "choose another folder (nothing was written)")
  if found is None and os.path.isdir(out) and os.listdir(out):
    raise errors.UserError(f"{out} holds files and is not a corpus this script wrote (no "
                           f"{MARKER} file): it is left as it is; choose another folder or "
                           "move it away (nothing was written)")
  parent = os.path.dirname(out)
  destinations.check_folder(parent, what="the corpus", flag="folder", need_bytes=SIZE_BYTES)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  old = None
  try:
    with destinations.writing(f"the corpus {out}", f"{out} is as it was", under=parent):
      os.mkdir(tmp)
      _write(tmp, version)
      if found is not None:   # another Python's corpus: set aside, removed once replaced
        old = tmp + ".old"
        os.rename(out, old)
      os.replace(tmp, out)    # over an empty folder, or where nothing is
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if old is not None and not os.path.lexists(out):
      os.rename(old, out)
    raise
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)
  return out


def main(argv=None) -> int:
  p = command.Parser(prog=NAME, description=__doc__.split("\n", maxsplit=1)[0])
  p.add_argument("folder", nargs="?", default="runs/corpora/pystdlib",
                 type=args.output_folder("the corpus", "folder"),
                 help="where the corpus goes (default: %(default)s)")
  print(prepare(p.parse_args(argv).folder))
  return 0


if __name__ == "__main__":
  command.exit_with(command.run(main, name=NAME, stopped="nothing of the corpus was left: run it again"))
