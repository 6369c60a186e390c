"""A second, held-out corpus for the comparisons: the Python standard library's source.

  python experiments/pystdlib_corpus.py DIR      # writes DIR/<module path>.txt, one per module

Offline on every machine with Python: the .py files of this interpreter's standard library
(CPython 3.11 here: 562 modules, 10.6 MB of code with English docstrings and comments), minus
the test suites, IDLE, tkinter, lib2to3, turtledemo, ensurepip and site-packages, one
document per module. Then train on it with `--config.data.path=DIR` (the text-folder TFDS
builder splits it by document). Chosen because it differs from Shakespeare in every way that
matters to a language model, and no hyper-parameter of this project was tuned on it.
"""
from __future__ import annotations

import pathlib
import sys
import sysconfig

SKIP = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "tkinter",
        "ensurepip", "__pycache__"}


def modules() -> list[pathlib.Path]:
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return [p for p in sorted(root.rglob("*.py"))
          if not set(p.relative_to(root).parts[:-1]) & SKIP
          and not p.relative_to(root).parts[0].startswith("config-")]


def prepare(directory: str) -> str:
  """Writes the corpus once (a marker file records the Python version); returns the folder."""
  out = pathlib.Path(directory)
  marker = out / "PYTHON_VERSION"
  version = sys.version.split()[0]
  if marker.exists() and marker.read_text() == version:
    return str(out)
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  for src in modules():
    dst = out / (str(src.relative_to(root)).replace("/", "__") + ".txt")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(src.read_text(encoding="utf-8", errors="replace"), encoding="utf-8")
  marker.write_text(version)
  return str(out)


if __name__ == "__main__":
  print(prepare(sys.argv[1] if len(sys.argv) > 1 else "runs/corpora/pystdlib"))
