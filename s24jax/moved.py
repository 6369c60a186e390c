"""Module paths that moved in s24jax 0.4 (the library, its commands and its tools in their own
folders): the old path answers one line naming the new one, instead of "No module named".

`python -m <old path>` prints that line and exits with code 2, running nothing; `import <old
path>` raises ImportError with the same sentence. A meta path finder installed by
`s24jax/__init__.py` answers for exactly the names in MOVED, nothing else.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

# The commands and tools (`python -m`), then the library modules a notebook may import.
MOVED = {
    "s24jax.evaluate": "s24jax.cli.evaluate",
    "s24jax.export": "s24jax.cli.export",
    "s24jax.flops": "s24jax.cli.flops",
    "s24jax.plan": "s24jax.perf.plan",
    "s24jax.plan_gemms": "s24jax.perf.plan_gemms",
    "s24jax.gpu_report": "s24jax.perf.gpu_report",
    "s24jax.step_model": "s24jax.perf.step_time",
    "s24jax.compare": "s24jax.cli.compare",
    "s24jax.loop": "s24jax.training.loop",
    "s24jax.train": "s24jax.training.train",
    "s24jax.config": "s24jax.training.config",
    "s24jax.model": "s24jax.nn.model",
    "s24jax.llama": "s24jax.nn.llama",
    "s24jax.sparse_linear": "s24jax.nn.sparse_linear",
    "s24jax.act_sparsity": "s24jax.nn.act_sparsity",
    "s24jax.trained": "s24jax.training.trained",
}
EXIT_USER = 2   # errors.EXIT_USER (not imported: this module runs before anything else)


def sentence(old: str) -> str:
  return (f"{old} moved to {MOVED[old]} in s24jax 0.4 (same arguments and contents): "
          f"use that path (README, \"Layout\")")


class _Loader(importlib.abc.InspectLoader):
  """Runs as a script (`python -m`): the line and exit 2. Imported: ImportError."""

  def __init__(self, old: str):
    self.old = old

  def get_source(self, fullname):
    return (f"import sys\nsys.stderr.write({sentence(self.old)!r} + "
            f"' (exit code {EXIT_USER})\\n')\nsys.exit({EXIT_USER})\n")

  def is_package(self, fullname):
    return False

  def exec_module(self, module):
    raise ImportError(sentence(self.old), name=self.old)


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, fullname, path=None, target=None):
    if fullname not in MOVED:
      return None
    return importlib.machinery.ModuleSpec(fullname, _Loader(fullname), origin="moved")


def install() -> None:
  """Puts the finder last on sys.meta_path (once): it answers only where nothing else does."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
