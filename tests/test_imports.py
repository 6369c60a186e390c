"""Tests of the source layout of s24jax/ and kernels/ (installed as s24jax.kernels), read from
the source files (nothing is imported): the import graph, the package structure, file sizes.

Every import statement counts, at module level or inside a function (a function-local import
is still a dependency, only a later one); imports under `if TYPE_CHECKING:` never run and are
skipped. `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`
(its __init__); relative imports are resolved against the importing module's package.

Checked:
  * no import cycle, reported per part (s24jax.kernels, the rest of s24jax) as a path of
    modules with the line of each import;
  * kernels/ imports no s24jax module outside s24jax.kernels (it is installable and testable
    without the training library);
  * the layers import only downwards (LAYERS: the foundation, then data/ and sparse_ops/,
    methods/, nn/, training/, and above the library cli/ and perf/); no library module
    imports a command or a tool (TOOLS: s24jax.cli, s24jax.perf, the kernel benchmarks' and
    compile check's commands, launch.py);
  * the restructured modules are where they belong: s24jax/sparse_ops/ is a package with one
    file per backend (never again the single s24jax/sparse_ops.py), reached by the rest of
    the library only through the package (`get_backend`); chores.py, step_info.py and
    run_spec.py exist and hooks.py is gone; step_info.py, which the methods, the step and
    the loop all read, imports no s24jax module;
  * no source file is over MAX_LINES lines unless its module docstring says why, in a
    sentence that gives the count ("Over 400 lines, ...") and a reason (as kernels/_common.py
    does).

The scanner and the docstring rule are themselves tested on planted files, so the checks
cannot pass vacuously.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source folder -> the package it is installed as (pyproject.toml's package-dir).
PACKAGE_DIRS = {"s24jax": "s24jax", "kernels": "s24jax.kernels"}
KERNELS = "s24jax.kernels"
# Commands and tools: modules that may import the library, never the other way round.
TOOLS = ("s24jax.cli", "s24jax.perf", "s24jax.kernels.bench", "s24jax.kernels.compile_check",
         "launch")
# The library's layers, lowest first: a module imports only from its own layer and those
# below it (a package listed is its modules; anything of s24jax not listed is the
# foundation, layer 0; s24jax.kernels imports nothing of the rest and is below everything).
LAYERS = (("s24jax.data", "s24jax.sparse_ops"), ("s24jax.methods",), ("s24jax.nn",),
          ("s24jax.training",), ("s24jax.cli",), ("s24jax.perf", "launch"))
EXTRA_MODULES = {"launch": "launch.py"}   # tools outside the package (scanned, and a target)
SPARSE_OPS = "s24jax.sparse_ops"
# One file per backend of the sparse linear op (s24jax/sparse_ops/<name>.py), and the shared
# ones; the rest of the library reaches a backend only through the package (`get_backend`).
SPARSE_OPS_BACKENDS = ("xla", "pallas", "tcgen05", "cusparselt")
SPARSE_OPS_SHARED = ("backend", "common", "options")
# Modules of the restructuring that must exist, and the ones they replaced.
REQUIRED_MODULES = ("s24jax.chores", "s24jax.step_info", "s24jax.training.run_spec", SPARSE_OPS,
                    "s24jax.nn", "s24jax.training", "s24jax.cli", "s24jax.perf",
                    *(f"{SPARSE_OPS}.{m}" for m in SPARSE_OPS_BACKENDS + SPARSE_OPS_SHARED))
RETIRED_MODULES = ("s24jax.hooks", "s24jax.loop", "s24jax.model", "s24jax.plan",
                   "s24jax.gpu_report", "s24jax.step_model", "s24jax.export")
MAX_LINES = 400


def find_modules(root: pathlib.Path, package_dirs=PACKAGE_DIRS,
                 extra=EXTRA_MODULES) -> dict[str, pathlib.Path]:
  """Dotted module name -> source file."""
  mods = {}
  for folder, package in package_dirs.items():
    base = root / folder
    for dirpath, dirnames, files in os.walk(base):
      dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
      rel = pathlib.Path(dirpath).relative_to(base).parts
      for f in sorted(files):
        if not f.endswith(".py"):
          continue
        parts = [package, *rel] + ([] if f == "__init__.py" else [f[:-3]])
        mods[".".join(parts)] = pathlib.Path(dirpath) / f
  for name, rel_path in extra.items():
    if (root / rel_path).exists():
      mods[name] = root / rel_path
  return mods


def _is_type_checking(test: ast.expr) -> bool:
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
      isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
  """Every Import / ImportFrom in the tree, skipping `if TYPE_CHECKING:` bodies."""
  stack = [tree]
  while stack:
    node = stack.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
    if isinstance(node, ast.If) and _is_type_checking(node.test):
      stack.extend(node.orelse)
      continue
    stack.extend(ast.iter_child_nodes(node))


def _known_prefix(name: str, mods) -> str | None:
  """The longest dotted prefix of `name` that is a scanned module (None: external)."""
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    cand = ".".join(parts[:i])
    if cand in mods:
      return cand
  return None


def import_edges(mods: dict[str, pathlib.Path]) -> dict[str, dict[str, int]]:
  """module -> {imported scanned module: line of the first such import}."""
  edges: dict[str, dict[str, int]] = {}
  for mod, path in mods.items():
    is_package = path.name == "__init__.py"
    package = mod if is_package else mod.rpartition(".")[0]
    out: dict[str, int] = {}
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
      targets = []
      if isinstance(node, ast.Import):
        targets = [_known_prefix(a.name, mods) for a in node.names]
      else:
        base = node.module or ""
        if node.level:
          parts = package.split(".")
          keep = len(parts) - (node.level - 1)
          if keep <= 0:
            raise ValueError(f"{path}:{node.lineno}: relative import beyond the top package")
          base = ".".join(parts[:keep] + ([base] if base else []))
        for a in node.names:
          sub = f"{base}.{a.name}"
          targets.append(sub if sub in mods else _known_prefix(base, mods))
      for t in targets:
        if t is not None and t != mod:
          out.setdefault(t, node.lineno)
    edges[mod] = out
  return edges


def strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
  """The import cycles: strongly connected components of more than one module (Tarjan,
  iterative), or a module importing itself."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  sccs = []
  counter = 0
  for start in sorted(edges):
    if start in index:
      continue
    work = [(start, iter(sorted(edges.get(start, ()))))]
    index[start] = low[start] = counter
    counter += 1
    stack.append(start)
    on_stack.add(start)
    while work:
      v, it = work[-1]
      w = next(it, None)
      if w is not None:
        if w not in index:
          index[w] = low[w] = counter
          counter += 1
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(sorted(edges.get(w, ())))))
        elif w in on_stack:
          low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          x = stack.pop()
          on_stack.discard(x)
          comp.append(x)
          if x == v:
            break
        if len(comp) > 1 or v in edges.get(v, {}):
          sccs.append(sorted(comp))
  return sccs


def cycle_path(comp: list[str], edges, mods) -> str:
  """One concrete cycle through the component, as 'a (file:line) -> b ... -> a'."""
  members = set(comp)
  start = comp[0]
  # Breadth-first from start's successors back to start, inside the component.
  prev = {}
  frontier = [start]
  found = False
  while frontier and not found:
    nxt = []
    for v in frontier:
      for w in sorted(edges[v]):
        if w not in members:
          continue
        if w == start:
          prev.setdefault(("end",), v)
          found = True
          break
        if w not in prev:
          prev[w] = v
          nxt.append(w)
      if found:
        break
    frontier = nxt
  back = []
  v = prev[("end",)]
  while v != start:
    back.append(v)
    v = prev[v]
  path = [start, *back[::-1], start]
  steps = []
  for a, b in zip(path, path[1:]):
    rel = os.path.relpath(mods[a], ROOT)
    steps.append(f"{a} ({rel}:{edges[a][b]})")
  return " -> ".join(steps + [path[-1]])


class _Graph(tuple):
  def __repr__(self):   # pytest prints fixtures of a failing test: keep that one line
    return f"<import graph of {len(self[0])} modules>"


@pytest.fixture(scope="module")
def graph():
  mods = find_modules(ROOT)
  assert f"{KERNELS}._common" in mods and SPARSE_OPS in mods, sorted(mods)
  return _Graph((mods, import_edges(mods)))


def _in(mod: str, package: str) -> bool:
  return mod == package or mod.startswith(package + ".")


def _is_tool(mod: str) -> bool:
  return any(_in(mod, t) for t in TOOLS)


@pytest.mark.parametrize("part", ["s24jax.kernels", "s24jax outside s24jax.kernels"])
def test_no_import_cycles(graph, part):
  mods, edges = graph
  cycles = [comp for comp in strongly_connected(edges)
            if any(_in(m, KERNELS) for m in comp) == (part == KERNELS)]
  assert not cycles, (
      f"{len(cycles)} import cycle(s) in {part} (function-local imports count):\n"
      + "\n".join(f"  modules {comp}\n    e.g. {cycle_path(comp, edges, mods)}"
                  for comp in cycles))


def test_kernels_import_nothing_of_s24jax_outside_kernels(graph):
  mods, edges = graph
  bad = [f"{a} ({os.path.relpath(mods[a], ROOT)}:{line}) imports {b}"
         for a in sorted(edges) if _in(a, KERNELS)
         for b, line in sorted(edges[a].items()) if not _in(b, KERNELS)]
  assert not bad, "kernels/ must import only inside s24jax.kernels:\n  " + "\n  ".join(bad)


def test_library_imports_no_tool(graph):
  mods, edges = graph
  assert all(t in mods for t in TOOLS), [t for t in TOOLS if t not in mods]
  bad = [f"{a} ({os.path.relpath(mods[a], ROOT)}:{line}) imports the tool {b}"
         for a in sorted(edges) if not _is_tool(a)
         for b, line in sorted(edges[a].items()) if _is_tool(b)]
  assert not bad, "library modules must not import tools:\n  " + "\n  ".join(bad)


def test_the_scan_sees_function_local_relative_cycles(tmp_path):
  """The checks above would pass vacuously if the scan missed edges: a planted cycle
  through a function-local `from . import` and a `from pkg.sub import name` is found,
  and `from . import name` of a non-module points at the package."""
  pkg = tmp_path / "pkg"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("from .a import f\n")
  (pkg / "a.py").write_text("def f():\n  from . import b\n  return b\n")
  (pkg / "b.py").write_text("from pkg.sub.c import g\n")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "sub" / "c.py").write_text("from .. import a\nfrom .. import f\n"
                                    "from typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n  import pkg.b\n")
  mods = find_modules(tmp_path, {"pkg": "pkg"}, {})
  edges = import_edges(mods)
  assert edges["pkg.a"] == {"pkg.b": 2}
  assert edges["pkg.sub.c"] == {"pkg.a": 1, "pkg": 2}
  assert strongly_connected(edges) == [["pkg", "pkg.a", "pkg.b", "pkg.sub.c"]]
  path = cycle_path(["pkg.a", "pkg.b", "pkg.sub.c"], edges, mods)
  assert path.startswith("pkg.a (") and path.endswith("-> pkg.a"), path
  assert [step.split(" (")[0] for step in path.split(" -> ")] == [
      "pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"], path


# ----------------------------------------------------------------------------------------------
# The restructured modules
# ----------------------------------------------------------------------------------------------


def layer(mod: str) -> int:
  """The layer of a module (LAYERS); the foundation is 0, s24jax.kernels -1."""
  if _in(mod, KERNELS):
    return -1
  for i, names in enumerate(LAYERS, start=1):
    if any(_in(mod, n) for n in names):
      return i
  return 0


def test_layers_import_only_downwards(graph):
  mods, edges = graph
  bad = [f"{a} (layer {layer(a)}, {os.path.relpath(mods[a], ROOT)}:{line}) imports {b} "
         f"(layer {layer(b)})"
         for a in sorted(edges) for b, line in sorted(edges[a].items())
         if b in mods and layer(b) > layer(a)]
  assert not bad, "an import climbs back up a layer:\n  " + "\n  ".join(bad)


def test_the_layer_rule_sees_a_planted_climb():
  planted = {"s24jax.nn.model": {"s24jax.training.loop": 3}}
  assert layer("s24jax.nn.model") < layer("s24jax.training.loop")
  assert layer("s24jax.errors") == 0 and layer("s24jax.kernels.masks") == -1
  assert layer("launch") == layer("s24jax.perf.plan") > layer("s24jax.cli.export")
  assert [(a, b) for a in planted for b in planted[a] if layer(b) > layer(a)]


def test_restructured_modules_exist_and_retired_ones_are_gone(graph):
  mods, _ = graph
  assert [m for m in REQUIRED_MODULES if m not in mods] == [], sorted(mods)
  assert [m for m in RETIRED_MODULES if m in mods] == []


def test_sparse_ops_is_a_package_with_one_file_per_backend(graph):
  mods, edges = graph
  folder = ROOT / "s24jax" / "sparse_ops"
  assert not (ROOT / "s24jax" / "sparse_ops.py").exists(), (
      "s24jax/sparse_ops.py is back as a single file; the op is the package s24jax/sparse_ops/ "
      "with one file per backend")
  assert mods[SPARSE_OPS] == folder / "__init__.py"
  for name in SPARSE_OPS_BACKENDS:
    assert mods[f"{SPARSE_OPS}.{name}"] == folder / f"{name}.py"
    # The package registers every backend: its __init__ imports each backend's file.
    assert f"{SPARSE_OPS}.{name}" in edges[SPARSE_OPS], (name, sorted(edges[SPARSE_OPS]))
  backends = {f"{SPARSE_OPS}.{name}" for name in SPARSE_OPS_BACKENDS}
  # (A tool may reach into a backend: s24jax.perf.gpu_report times cuSPARSELt's GEMMs one by one.)
  bad = [f"{a} ({os.path.relpath(mods[a], ROOT)}:{line}) imports {b}"
         for a in sorted(edges) if not _in(a, SPARSE_OPS) and not _is_tool(a)
         for b, line in sorted(edges[a].items()) if b in backends]
  assert not bad, ("outside s24jax.sparse_ops, reach a backend through the package "
                   "(sparse_ops.get_backend), not its module:\n  " + "\n  ".join(bad))


def test_step_info_imports_nothing_of_s24jax(graph):
  """step_info.py is read by the methods (on the device), the step, the chores and the loop:
  it stays a leaf."""
  mods, edges = graph
  assert edges["s24jax.step_info"] == {}, edges["s24jax.step_info"]


# ----------------------------------------------------------------------------------------------
# File sizes
# ----------------------------------------------------------------------------------------------


def length_reason(docstring: str | None, limit: int = MAX_LINES) -> str | None:
  """The sentence of a module docstring that says why the file is over `limit` lines: it
  gives a count of at least `limit` ('Over 400 lines', '450 lines') followed by a reason (at
  least six more words). None if there is no such sentence."""
  text = " ".join((docstring or "").split())
  for sentence in re.split(r"(?<=[.!?])\s+", text):
    match = re.search(r"\b(\d+)\s+lines\b", sentence)
    if match and int(match.group(1)) >= limit and len(sentence[match.end():].split()) >= 6:
      return sentence
  return None


def source_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  """Every .py file of the library (the folders of PACKAGE_DIRS)."""
  return sorted(p for folder in PACKAGE_DIRS for p in (root / folder).rglob("*.py")
                if "__pycache__" not in p.parts)


def test_no_file_over_the_line_limit_without_a_reason():
  files = source_files()
  assert len(files) > 50 and ROOT / "kernels" / "_common.py" in files
  over = {p: len(p.read_text().splitlines()) for p in files}
  over = {p: n for p, n in over.items() if n > MAX_LINES}
  bad = [f"{os.path.relpath(p, ROOT)}: {n} lines" for p, n in sorted(over.items())
         if length_reason(ast.get_docstring(ast.parse(p.read_text(), str(p)))) is None]
  assert not bad, (
      f"files over {MAX_LINES} lines whose module docstring does not say why (a sentence "
      f"such as '(Over {MAX_LINES} lines, one module on purpose: <reason>.)'; see "
      "kernels/_common.py), or split them:\n  " + "\n  ".join(bad))


def test_the_length_rule_needs_a_count_and_a_reason():
  """The rule above on planted docstrings: a count without a reason, or 'lines' in another
  sense, does not excuse a long file."""
  common = ast.get_docstring(ast.parse((ROOT / "kernels" / "_common.py").read_text()))
  assert length_reason(common).startswith("(Over 400 lines, one module on purpose:")
  assert length_reason("Top.\n\n(Over 400 lines, one module on purpose: the format and\n"
                       "its helpers are one contract.)") is not None
  assert length_reason("It has 512 lines because the three kernels share one tiling.")
  assert length_reason("Over 400 lines.") is None                       # no reason
  assert length_reason("Over 400 lines. The kernels share one tiling and must stay "
                       "together.") is None                              # not in one sentence
  assert length_reason("The loop, a few lines around chores, runs them in order each "
                       "step.") is None                                  # no count
  assert length_reason("Reads 12 lines of the header and then every record that "
                       "follows.") is None                               # a small count
  assert length_reason(None) is None


# The Pallas Triton backend is deprecated (jax 0.11, 0.12): importing s24jax must survive its
# removal, so it is imported only inside the functions that build a Triton kernel
# (docs/kernels.md, "The Pallas Triton backend's deprecation").
TRITON_MODULE = "jax.experimental.pallas.triton"


def module_level_triton_imports(path: pathlib.Path) -> list[int]:
  """Lines of `path` that import the Pallas Triton backend when the module is imported (at
  module level, or in a module-level if/try block; not inside a function or class)."""
  lines = []

  def visit(nodes):
    for node in nodes:
      if isinstance(node, ast.Import):
        if any(a.name == TRITON_MODULE or a.name.startswith(TRITON_MODULE + ".")
               for a in node.names):
          lines.append(node.lineno)
      elif isinstance(node, ast.ImportFrom):
        names = [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
        if any(n == TRITON_MODULE or n.startswith(TRITON_MODULE + ".") for n in names):
          lines.append(node.lineno)
      elif isinstance(node, (ast.If, ast.Try, ast.With)):
        visit([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
               *[s for h in getattr(node, "handlers", []) for s in h.body]])

  visit(ast.parse(path.read_text()).body)
  return lines


def test_the_triton_backend_is_never_imported_at_module_level(tmp_path):
  bad = [f"{f.relative_to(ROOT)}:{line}" for folder in PACKAGE_DIRS
         for f in sorted((ROOT / folder).rglob("*.py"))
         for line in module_level_triton_imports(f)]
  assert not bad, f"{TRITON_MODULE} imported at module level: {bad}"
  planted = tmp_path / "planted.py"
  planted.write_text("import os\ntry:\n  from jax.experimental.pallas import triton as t\n"
                     "except ImportError:\n  pass\n\ndef f():\n"
                     "  import jax.experimental.pallas.triton\n")
  assert module_level_triton_imports(planted) == [3]      # the function's import is fine
