"""What the experiments/ scripts share beyond s24jax/cli/command.py and args.py: argument types
for comma-separated lists (run names, seeds, thread counts), child processes stopped with the
script (`stopping_children`, `ChildFailed`), and the comparison scripts' command line
(`comparison_parser`, `compare`) on s24jax/cli/compare.py's engine, which reuses a run already
in a script's folder only if it was made with the config asked for (`compare.check_reusable`,
which the scripts that run launch.py use too).

Imported by the scripts after `command.guard_startup`; what needs jax is imported where it is
used, so a script that needs none (plan_table.py) starts fast.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
from typing import Callable, Iterator, Sequence

from s24jax import errors
from s24jax.cli import args
from s24jax.cli import command

# What a Ctrl-C outside a training loop leaves (`command.run(..., stopped=STOPPED)`); inside
# one, the run saves its step and says so itself (s24jax/training/preemption.py).
STOPPED = ("the runs finished so far are intact, a run stopped in training saved its step: run "
           "the same command again to go on")


def names(valid: Sequence[str], what: str) -> Callable[[str], list[str]]:
  """A comma-separated list of `valid` names (`what`: e.g. 'runs'), each once, in the order
  given."""
  def parse(text: str) -> list[str]:
    given = text.split(",")
    unknown = [n for n in given if n not in valid]
    if unknown:
      raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, unknown))}; "
                                       f"valid: {', '.join(valid)} (comma-separated)")
    return list(dict.fromkeys(given))
  return parse


def integers(*, minimum: int | None = None, maximum: int | None = None
             ) -> Callable[[str], list[int]]:
  """A comma-separated list of integers in [minimum, maximum] (args.integer's), each once."""
  one = args.integer(minimum=minimum, maximum=maximum)
  return lambda text: list(dict.fromkeys(one(t) for t in text.split(",")))


def pin(child: subprocess.Popen, cores: set[int]) -> None:
  """Pins the child just started to `cores` (so XLA:CPU sizes its thread pool to them). Set
  from here, not in the child before exec (preexec_fn: Python code between fork and exec, which
  may deadlock in a process running JAX's threads): the threads the child starts later inherit
  it, and Python starts none before the imports that start XLA's. A child already gone is let
  be."""
  try:
    os.sched_setaffinity(child.pid, cores)
  except ProcessLookupError:
    pass


class ChildFailed(errors.KnownError):
  """A run the script started (a child process) failed: its exit code is the script's."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code


@contextlib.contextmanager
def stopping_children(children: list[subprocess.Popen]) -> Iterator[None]:
  """If the block raises (Ctrl-C or SIGTERM: command.run's KeyboardInterrupt; or an error),
  each child in `children` still running gets SIGTERM and is waited for: a training run
  saves the checkpoint of its step and exits 75 (a second signal, the terminal's SIGINT it
  may have had too, is ignored while it saves: s24jax/training/preemption.py). A child is
  never killed: its checkpoint would be cut short."""
  try:
    yield
  except BaseException:
    for child in children:
      if child.poll() is None:
        child.send_signal(signal.SIGTERM)
    for child in children:
      child.wait()
    raise


# ---------------------------------------------------------------------------------------------
# The comparison scripts (experiments/compare_*.py but compare_recipes.py).


def comparison_parser(description: str, run_names: Sequence[str], default_root: str, *,
                      prog: str) -> command.Parser:
  """--root (a folder this process can write), --steps N (>= 1; default: each config's own),
  --only a,b (known run names): compare.script_main's arguments, checked."""
  p = command.Parser(prog=prog, description=description)
  p.add_argument("--root", default=default_root,
                 type=args.output_folder("the comparison's runs and table", "--root"),
                 help="a workdir per run, and table.md (default: %(default)s)")
  p.add_argument("--steps", type=args.integer(minimum=1), default=None,
                 help="total_steps of every run (default: each config's own)")
  p.add_argument("--only", type=names(run_names, "runs"), default=None,
                 help=f"comma-separated run names: {', '.join(run_names)}")
  return p


def compare(parsed: argparse.Namespace, runs, description: str, *,
            extra_keys: dict[str, str] | None = None, appendix=None) -> str:
  """compare.script_main on the checked arguments (`comparison_parser`'s) for `runs`
  (compare.Arm); its run_all checks every chosen run's config, and the run already in its
  workdir, before any run starts. Returns the table."""
  from s24jax.cli import compare as compare_lib  # pylint: disable=g-import-not-at-top (jax)
  argv = ["--root", parsed.root, *(["--steps", str(parsed.steps)] if parsed.steps else []),
          *(["--only", ",".join(parsed.only)] if parsed.only else [])]
  return compare_lib.script_main(description, runs, parsed.root, extra_keys=extra_keys,
                                 appendix=appendix, argv=argv)
