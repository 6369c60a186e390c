"""The commands of `python -m s24jax.perf.step_time` (the package docstring), on the error path
every command shares (s24jax/cli/command.py): a bad argument, config or file is one line and
exit code 2 before anything is compiled or written; a file it writes (--save, --json, --out)
replaces only a file of its own kind (a census file, a predictions file: never the
calibration by mistake), its folder made if missing; a write that fails meanwhile is one line
and 5; Ctrl-C one line and 75.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import subprocess
import sys
from typing import Any

from s24jax import destinations
from s24jax import errors
from s24jax.cli import args as cli_args
from s24jax.cli import command
from s24jax.perf import outputs
from s24jax.kernels import aot
from s24jax.perf.step_time import build
from s24jax.perf.step_time import calibration as cal
from s24jax.perf.step_time import predict
from s24jax.perf.step_time import tables
from s24jax.perf.step_time import validation


def calibrate(path=cal.CALIBRATION) -> dict[str, validation.DeviceFit]:
  """device -> the model fitted to its measured rows (validation.fit_all)."""
  return validation.fit_all(cal.load_calibration(path), pathlib.Path(path).name)


def _git_revision() -> str:
  try:
    out = subprocess.run(["git", "-C", str(cal.REPO), "describe", "--always", "--dirty"],
                         capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"


# ---------------------------------------------------------------------------------------------
# census


def census(args) -> int:
  if args.hlo:
    kernels, memory, config = build.hlo_census(args.hlo), None, None
  else:
    _start()
    config, kernels, memory = build.compile_census(args.config, args.backend, args.set,
                                                   args.micro, args.gpu, args.cache)
  fits = calibrate() if cal.CALIBRATION.exists() else {}
  first = next(iter(fits.values()), None)   # the cells' model ms: the first device's
  c, table = (first.constants, first.table) if first else (None, None)
  name = args.name or (args.config or args.hlo)
  print(tables.census_markdown({name: kernels}, c, table))
  if first is not None:
    print(f"(launches / TFLOP / GB / model ms on the {first.device} per step; "
          f"{c.describe()}: a prediction)")
    print("model step ms: " + ", ".join(f"{d} {tables.model_ms(f, kernels)}"
                                        for d, f in fits.items()))
  else:
    print("(launches / TFLOP / GB per step)")
  if memory:
    print(f"compiled memory: {memory['total_bytes'] / 2**30:.2f} GiB")
  if not all(k.trips_known for k in kernels):
    print("note: a while loop without a known trip count was counted once")
  if args.kernels:
    print(tables.top_kernels(kernels, c, table, args.kernels))
  if args.save:
    cal.save_census(args.save, name, {
        "config": args.config, "backend": args.backend, "overrides": list(args.set),
        "revision": _git_revision(), "jax": _jax_version(), "memory": memory,
        "kernels": cal.compact(kernels)})
    print(f"saved as {name!r} in {args.save}")
  return errors.EXIT_OK


# ---------------------------------------------------------------------------------------------
# report


def report(args) -> int:
  fits = calibrate(args.calibration)
  for fit in fits.values():
    print(tables.validation_markdown(fit) + "\n")
    print(f"### The censuses of the measured steps on the {fit.device} "
          "(launches / TFLOP / GB / model ms)\n")
    print(tables.census_markdown({m.row.name: m.row.kernels for m in fit.rows},
                                 fit.constants, fit.table) + "\n")
  rows = _predictions(args, fits, predict.wanted(args.rows))
  if args.json:
    _write(args.json, fits, rows, args)
  return errors.EXIT_OK


# ---------------------------------------------------------------------------------------------
# predict (and report --json)


def predict_command(args) -> int:
  fits = calibrate(args.calibration)
  if args.config:
    chosen = [(args.config, args.config, args.backend, tuple(args.set), args.micro)]
  else:
    chosen = predict.wanted(args.rows)
  _write(args.out, fits, _predictions(args, fits, chosen), args)
  return errors.EXIT_OK


def _predictions(args, fits, chosen) -> list[dict[str, Any]]:
  rows = []
  if chosen:
    _start()
  for name, spec, backend, overrides, micro in chosen:
    rows += predict.predict(name, spec, backend, overrides, micro, fits, args.cache or None)
    print(f"{name} {rows[-1]['recipe']} {backend}: " + ", ".join(
        f"{r['device']} {tables.ms(r['step_ms'])} ms" for r in rows[-len(fits):]), flush=True)
  for device in fits if rows else ():
    print(f"\n### Predicted on the {device} (not measured)\n")
    print(tables.predictions_markdown([r for r in rows if r["device"] == device]))
  return rows


def _write(path: str, fits, rows, args) -> None:
  argv = list(sys.argv[1:] if args.argv is None else args.argv)
  if "--cache" in argv:   # where compiles are cached changes nothing in the file
    del argv[argv.index("--cache"):argv.index("--cache") + 2]
  out = predict.document(fits, rows, args.calibration,
                         "python -m s24jax.perf.step_time " + shlex.join(argv))
  outputs.write(path, json.dumps(out, indent=1) + "\n", what="the predictions file",
                replaces=_of_format(predict.FORMAT),
                intact="The file is as it was (the tables above are complete)")
  print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------


def _jax_version() -> str:
  import jax   # pylint: disable=g-import-not-at-top
  return jax.__version__


def _start() -> None:
  try:
    aot.start()
  except aot.PluginMissing as e:
    raise errors.UserError(str(e)) from None


# argparse types (a string default goes through its type too: the optional files default to
# None, which does not).
_MICRO = cli_args.integer(minimum=1)
_CACHE = cli_args.output_folder("the compile cache", "--cache")


def _parser() -> argparse.ArgumentParser:
  p = command.Parser(prog="python -m s24jax.perf.step_time",
                     description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  c = sub.add_parser("census", help="the kernels of one compiled step, per category")
  c.add_argument("--config", help="experiments/X.py[:variant]")
  c.add_argument("--backend", default="xla", help="sparsity.backend (xla, cusparselt, ...)")
  c.add_argument("--micro", type=_MICRO, default=None,
                 help="sequences per micro-batch (default: the config's)")
  c.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
  c.add_argument("--gpu", default="h100", choices=aot.TARGETS)
  c.add_argument("--hlo", default="", help="read optimized HLO text instead of compiling")
  c.add_argument("--kernels", type=cli_args.integer(minimum=0), default=0,
                 help="list the N costliest kernels")
  c.add_argument("--save", default=None, help="add the census to this census file",
                 type=cli_args.output_file("a step-model census file", "--save",
                                           replaces=lambda q: not cal.not_a_census(q)))
  c.add_argument("--name", default="", help="its name there")
  c.add_argument("--cache", default=None, type=_CACHE, help="a folder caching compiled HLO")
  r = sub.add_parser("report", help="calibrate on the measured runs (per device, errors in-"
                      "sample and leave-one-out), predict, write JSON")
  r.add_argument("--json", default=None, help="write the predictions file here (as predict)",
                 type=_predictions_file("--json"))
  _model_options(r)
  f = sub.add_parser("predict", help="write the predictions file from the current code and "
                     "the calibration")
  f.add_argument("--out", required=True, help="the predictions file to write",
                 type=_predictions_file("--out"))
  _model_options(f)
  f.add_argument("--config", default="", help="one config instead of --rows: "
                 "experiments/X.py[:variant]")
  f.add_argument("--backend", default="xla", help="with --config: sparsity.backend")
  f.add_argument("--micro", type=_MICRO, default=None, help="with --config: its micro-batch")
  f.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
  return p


def _model_options(p: argparse.ArgumentParser) -> None:
  """report's and predict's: the rows predicted, the calibration, the compile cache."""
  p.add_argument("--rows", default=None,
                 help="comma-separated PREDICTIONS names ('' for the calibration only)")
  p.add_argument("--calibration", default=str(cal.CALIBRATION),
                 type=cli_args.input_file("a census file", kind=cal.not_a_census),
                 help="the census file the model is fitted to")
  p.add_argument("--cache", default=None, type=_CACHE, help="a folder caching compiled HLO")


def _predictions_file(flag: str):
  """A predictions file to write: an existing file only if it is one (never the calibration
  nor any other census file)."""
  return cli_args.output_file("a step-model predictions file", flag,
                              replaces=_of_format(predict.FORMAT))


def _check(args) -> None:
  """What the argument types cannot check alone (each UserError, before any work)."""
  if args.command == "census":
    if bool(args.config) == bool(args.hlo):
      raise errors.UserError("census needs --config or --hlo (one of them)")
    if args.save and not args.name:
      raise errors.UserError("--save needs --name (the row's name in the census file)")
    if args.config:   # the config loads without a compiler: a bad one fails here, one line
      build.step_config(args.config, args.backend, args.set, args.micro)
  else:
    names = [p[0] for p in predict.PREDICTIONS]
    bad = [n for n in (args.rows.split(",") if args.rows else []) if n not in names]
    if bad:
      raise errors.UserError(f"--rows {','.join(bad)}: not among {', '.join(names)}")
    if getattr(args, "config", ""):
      if args.rows is not None:
        raise errors.UserError("predict takes --config or --rows, not both")
      build.step_config(args.config, args.backend, args.set, args.micro)


def _of_format(fmt: str):
  """A `replaces` test for check_file: a JSON object whose "format" is `fmt` or an earlier
  version of it (".../1" for ".../2")."""
  test = destinations.json_with_keys("format", "rows")

  def replaces(path: str) -> bool:
    if not test(path):
      return False
    with open(path, encoding="utf-8") as f:
      return str(json.load(f)["format"]).split("/")[0] == fmt.split("/")[0]
  return replaces


def _main(argv) -> int:
  args = _parser().parse_args(argv)   # a malformed command line: one line, exit 2
  args.argv = argv
  _check(args)
  return {"census": census, "report": report, "predict": predict_command}[args.command](args)


def main(argv=None) -> int:
  """The command's exit code (s24jax/errors.py; the module docstring)."""
  return command.run(_main, argv, name="s24jax.perf.step_time",
                     stopped="nothing it wrote is partial (each file is written whole or not "
                             "at all): run it again")
