"""The planner's table: every GPT-2 size x {dense, s_ste, t_sr_ste_df} x {1, 8} GPUs.

  python experiments/plan_table.py [--gpu h100] [--root runs/plans] [--sizes 124m,...]

Runs `python -m s24jax.perf.plan --config experiments/gpt2_<method>.py:<size> --gpu GPU --devices N
--json ...` for each cell (one process each: a process compiles for one GPU; finished cells
are reused) and prints a markdown table: per-device memory, whether it fits, whether XLA had
to rematerialize, the micro-batch and accumulation, FLOPs per step, and for the cells that do
not fit as configured, the largest micro-batch per device that does. Needs the CUDA compile
plugin (requirements-gpu-aot.txt). Measured table: docs/scaling.md, "Planning a run".

Each cell is ROOT/<gpu>_<method>_<size>_<devices>.json, the planner's report, reused while it
is there (delete it to plan the cell again after changing an experiment file); a file there
that is not the report of that cell stops the script before any compile, as does a missing
plugin. A plan that fails (exit code other than 0, fits, or 6, does not fit) stops the script
with its exit code, the cells planned so far kept. The table goes to ROOT/table_<gpu>.md,
replacing only an earlier table of this script. Ctrl-C: exit code 75, the finished cells kept.
"""
from __future__ import annotations

from s24jax.cli import command

NAME = "experiments/plan_table.py"
if __name__ == "__main__":
  command.guard_startup(NAME)

# pylint: disable=wrong-import-position  (after the guard: Ctrl-C during imports is one line)
import json
import os
import subprocess
import sys

from s24jax import destinations
from s24jax import errors
from s24jax.cli import args
from s24jax.kernels import aot

import command_line  # pylint: disable=wrong-import-order  (experiments/, beside this file)

EXPERIMENTS = os.path.dirname(os.path.abspath(__file__))
SIZES = ("124m", "350m", "774m", "1558m")
METHODS = ("dense", "s_ste", "t_sr_ste_df")
DEVICES = (1, 8)
TABLE_HEAD = "| model | method | GPUs | "   # what tells an earlier table of this script
# A plan report as plan.py writes it, with every field `row` reads.
a_plan_report = destinations.json_with_keys(
    "fits", "gpu", "devices", "params", "config", "mesh", "micro_batch", "grad_accum_steps",
    "argument_size_in_bytes", "temp_size_in_bytes", "total_bytes_per_device",
    "xla_rematerialized", "flops_per_step")


def cell_path(root: str, gpu: str, size: str, method: str, devices: int) -> str:
  return os.path.join(root, f"{gpu}_{method}_{size}_{devices}.json")


def check_cell(path: str, gpu: str, devices: int) -> bool:
  """Whether the cell is planned already (its report there); a file there that is not the
  report of that GPU and device count: UserError."""
  if not os.path.lexists(path):
    return False
  if a_plan_report(path):
    with open(path, encoding="utf-8") as f:
      report = json.load(f)
    if report["gpu"] == gpu and report["devices"] == devices:
      return True
  raise errors.UserError(f"{path} is not this planner's report of {devices} {gpu} GPU(s): it "
                         "is left as it is; move it away or choose another --root (nothing "
                         "was planned)")


def cell(root: str, gpu: str, size: str, method: str, devices: int) -> dict:
  out = cell_path(root, gpu, size, method, devices)
  if not check_cell(out, gpu, devices):
    cmd = [sys.executable, "-m", "s24jax.perf.plan", "--config",
           os.path.join(EXPERIMENTS, f"gpt2_{method}.py:{size}"), "--gpu", gpu,
           "--devices", str(devices), "--json", out]
    print(" ".join(cmd[1:]), flush=True)
    child = subprocess.Popen(cmd)
    with command_line.stopping_children([child]):
      code = child.wait()
    if code not in (errors.EXIT_OK, errors.EXIT_DOES_NOT_FIT):
      raise command_line.ChildFailed(
          f"the plan of {method} {size} on {devices} {gpu} GPU(s) failed with exit code {code} "
          f"(its line above says why); the cells planned so far are kept in {root}", code)
  with open(out, encoding="utf-8") as f:
    return json.load(f)


def row(r: dict) -> str:
  gib = lambda b: f"{b / 2**30:.1f}"   # pylint: disable=unnecessary-lambda-assignment
  best = r.get("largest_fitting_micro_batch")
  suggestion = ("-" if r["fits"] else
                f"{best} (accum {r['grad_accum_steps_at_largest']})" if best else "none")
  return (f"| {r['params'] / 1e6:.0f}M | {r['config']} | {r['devices']} | "
          f"{r['mesh']['data']}x{r['mesh']['fsdp']} | {r['micro_batch']} x {r['grad_accum_steps']} | "
          f"{gib(r['argument_size_in_bytes'])} | {gib(r['temp_size_in_bytes'])} | "
          f"{gib(r['total_bytes_per_device'])} | {'yes' if r['fits'] else 'NO'} | "
          f"{'YES' if r['xla_rematerialized'] else 'no'} | {r['flops_per_step']:.3g} | "
          f"{suggestion} |")


def a_plan_table(path: str) -> bool:
  """Whether `path` is a table this script wrote (its first line is the table's head)."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.readline().startswith(TABLE_HEAD)
  except (OSError, UnicodeDecodeError):
    return False


def main(argv=None) -> int:
  p = command.Parser(prog=NAME, description=__doc__.split("\n")[0])
  p.add_argument("--gpu", default="h100", choices=tuple(aot.TARGETS))
  p.add_argument("--root", default="runs/plans",
                 type=args.output_folder("the plans and their table", "--root"))
  p.add_argument("--sizes", default=",".join(SIZES), type=command_line.names(SIZES, "sizes"))
  p.add_argument("--methods", default=",".join(METHODS),
                 type=command_line.names(METHODS, "methods"))
  parsed = p.parse_args(argv)
  cells = [(size, method, devices) for size in parsed.sizes for method in parsed.methods
           for devices in DEVICES]
  # Before the first compile: the cells there, the plugin if a cell needs it, the table.
  planned = [check_cell(cell_path(parsed.root, parsed.gpu, *c), parsed.gpu, c[2])
             for c in cells]
  if not all(planned):
    with errors.user_errors(aot.PluginMissing):
      aot.check_plugin()
  table_path = os.path.join(parsed.root, f"table_{parsed.gpu}.md")
  destinations.check_file(table_path, what="a plan table", flag="--root", replaces=a_plan_table)
  lines = [TABLE_HEAD + "mesh data x fsdp | micro x accum | arguments GiB | "
           "temporaries GiB | total GiB/GPU | fits | XLA remat | FLOPs/step | "
           "largest micro that fits |", "|" + "---|" * 12]
  lines += [row(cell(parsed.root, parsed.gpu, *c)) for c in cells]
  table = "\n".join(lines)
  print(table)
  with destinations.writing(f"the table {table_path}", "The table above is complete; the "
                            "cells' reports are intact"):
    destinations.write_atomic(table_path, table + "\n", replaces=a_plan_table,
                              what="a plan table")
  return 0


if __name__ == "__main__":
  command.exit_with(command.run(main, name=NAME, stopped="the cells planned so far are kept: run the "
                       "same command again to go on"))
