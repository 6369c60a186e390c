"""The commands of `python -m s24jax.step_model` (the package docstring)."""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from typing import Any

from s24jax import destinations
from s24jax import errors
from s24jax import roofline
from s24jax import step_census
from s24jax.kernels import aot
from s24jax.step_model import build
from s24jax.step_model import calibration as cal
from s24jax.step_model import tables

RECIPES = {"gpt2": {"dense": "experiments/gpt2_dense.py",
                    "hu2024": "experiments/gpt2_t_sr_ste_df.py",
                    "s_ste": "experiments/gpt2_s_ste.py"},
           "llama": {"dense": "experiments/llama_dense.py",
                     "hu2024": "experiments/llama_t_sr_ste_df.py",
                     "s_ste": "experiments/llama_s_ste.py"}}
# (recipe, sparsity.backend) of every predicted row: dense, and each sparse recipe on 'xla'
# and on 'cusparselt' with every GEMM on its 2:4 kernel (build.step_config).
ARMS = (("dense", "xla"), ("hu2024", "xla"), ("hu2024", "cusparselt"), ("s_ste", "xla"),
        ("s_ste", "cusparselt"))
# (name, family, config variant, overrides, micro-batch; None: the config's, 64 sequences).
# The first three are the GPU report's step rows (s24jax/gpu_report/steps.py: one device,
# its `variant` names them); the others are one device's share of the paper-scale runs on 8
# GPUs: 8 sequences per device and micro-batch, every layer, on one device (no collectives,
# the optimizer on the whole state: docs/scaling.md says what that leaves out).
PREDICTIONS = (
    ("124m", "gpt2", "124m", (), None),
    ("350m", "gpt2", "350m", (), None),
    ("1558m/2", "gpt2", "1558m", ("model.num_layers=2",), None),
    ("774m", "gpt2", "774m", (), 8),
    ("1558m", "gpt2", "1558m", (), 8),
    ("llama 1b", "llama", "1b", (), 8),
    ("llama 7b", "llama", "7b", (), 8),
)
GPU_REPORT_ROWS = ("124m", "350m", "1558m/2")


def calibrate():
  """(constants, cuSPARSELt table, calibration rows) fitted to the measured run."""
  table = cal.sparse_table()
  rows = cal.calibration_rows(cal.load_calibration(), cal.measured_steps())
  return roofline.fit(rows, table), table, rows


def _git_revision() -> str:
  try:
    out = subprocess.run(["git", "-C", str(cal.REPO), "describe", "--always", "--dirty"],
                         capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def _compile_census(spec: str, backend: str, overrides, micro, gpu: str, cache):
  config = build.step_config(spec, backend, overrides, micro)
  hlo, memory = build.compile_step(config, gpu, cache)
  return config, step_census.census(hlo), memory


# ---------------------------------------------------------------------------------------------
# census


def census(args) -> int:
  if args.hlo:
    kernels, memory, config = step_census.census(build.read_hlo(args.hlo)), None, None
  else:
    _start()
    config, kernels, memory = _compile_census(args.config, args.backend, args.set, args.micro,
                                              args.gpu, args.cache)
  c = table = None
  if cal.CALIBRATION.exists():
    c, table, _ = calibrate()
  name = args.name or (args.config or args.hlo)
  print(tables.census_markdown({name: kernels}, c, table))
  if c is not None:
    print(f"(launches / TFLOP / GB / model ms per step; {c.describe()}, fitted to the "
          f"{cal.RUN_DATE} H100 run: a prediction)")
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
  c, table, rows = calibrate()
  measured = [{"row": r.name, "measured_ms": 1e3 * r.seconds,
               "model_ms": 1e3 * roofline.step_seconds(r.kernels, c, table)} for r in rows]
  for m in measured:
    m["error"] = m["model_ms"] / m["measured_ms"] - 1
  print(f"## Calibration ({cal.RUN_DEVICE}, {cal.RUN_DATE}): {c.describe()}\n")
  print("| measured row | measured ms | model ms | error |\n|---|---|---|---|")
  for m in measured:
    print(f"| {m['row']} | {m['measured_ms']:.1f} | {m['model_ms']:.1f} | "
          f"{100 * m['error']:+.1f} % |")
  print("\n## The census of the measured steps (launches / TFLOP / GB / model ms)\n")
  print(tables.census_markdown({r.name.removeprefix("124m "): r.kernels for r in rows},
                               c, table))
  wanted = [p for p in PREDICTIONS
            if args.rows is None or p[0] in args.rows.split(",")]
  predictions = []
  if wanted:
    _start()
  for name, family, variant, overrides, micro in wanted:
    for recipe, backend in ARMS:
      spec = f"{cal.REPO / RECIPES[family][recipe]}:{variant}"
      config, kernels, memory = _compile_census(spec, backend, overrides, micro, "h100",
                                                args.cache)
      predictions.append(_prediction(name, recipe, backend, config, kernels, memory, c,
                                     table))
      p = predictions[-1]
      print(f"{name} {recipe} {backend}: {p['step_ms']:.1f} ms "
            f"({p['tokens_per_sec'] / 1e3:.0f}k tokens/s)", flush=True)
  if predictions:
    print("\n" + tables.predictions_markdown(predictions))
  out = {"format": "s24jax.step_model_predictions/1",
         "what": ("PREDICTIONS of the s24jax step-time model (s24jax/roofline.py), not "
                  "measurements: train-step milliseconds on one " + cal.RUN_DEVICE + ", from "
                  "deviceless compiles (jax " + _jax_version() + ") and constants fitted to "
                  "the step times of the " + cal.RUN_DATE + " H100 run"),
         "date": datetime.date.today().isoformat(), "revision": _git_revision(),
         "device": cal.RUN_DEVICE, "command": "python -m s24jax.step_model " +
         " ".join(sys.argv[1:] if args.argv is None else args.argv),
         "constants": {"flops_per_s": c.flops_per_s, "bytes_per_s": c.bytes_per_s,
                       "launch_s": c.launch_s, "fp8_speedup": roofline.FP8_SPEEDUP},
         "calibration": measured, "rows": predictions}
  if args.json:
    destinations.write_atomic(args.json, json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
  return errors.EXIT_OK


def _prediction(name, recipe, backend, config, kernels, memory, c, table) -> dict[str, Any]:
  seconds = roofline.step_seconds(kernels, c, table)
  tokens = int(config.batch_size) * int(config.model.seq_len)
  by_category = roofline.by_category(kernels, c, table)
  return {"name": name, "variant": name if name in GPU_REPORT_ROWS else None,
          "recipe": recipe, "backend": backend,
          "gemm_choice": config.sparsity.get("gemm_choice") if backend == "cusparselt" else None,
          "micro_batch": int(config.batch_size), "seq_len": int(config.model.seq_len),
          "num_layers": int(config.model.num_layers), "d_model": int(config.model.d_model),
          "step_ms": 1e3 * seconds, "tokens_per_sec": tokens / seconds,
          "launches": sum(k.count for k in kernels if not k.branch),
          "ms_by_category": {k: 1e3 * v for k, v in by_category.items() if v},
          "compiled_gib": memory["total_bytes"] / 2**30}


# ---------------------------------------------------------------------------------------------


def _jax_version() -> str:
  import jax   # pylint: disable=g-import-not-at-top
  return jax.__version__


def _start() -> None:
  try:
    aot.start()
  except aot.PluginMissing as e:
    raise errors.UserError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m s24jax.step_model",
                              description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  c = sub.add_parser("census", help="the kernels of one compiled step, per category")
  c.add_argument("--config", help="experiments/X.py[:variant]")
  c.add_argument("--backend", default="xla", help="sparsity.backend (xla, cusparselt, ...)")
  c.add_argument("--micro", type=int, default=None,
                 help="sequences per micro-batch (default: the config's)")
  c.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
  c.add_argument("--gpu", default="h100")
  c.add_argument("--hlo", default="", help="read optimized HLO text instead of compiling")
  c.add_argument("--kernels", type=int, default=0, help="list the N costliest kernels")
  c.add_argument("--save", default="", help="add the census to this census file")
  c.add_argument("--name", default="", help="its name there")
  c.add_argument("--cache", default="", help="a folder caching compiled HLO")
  r = sub.add_parser("report", help="calibrate on the measured run, predict, write JSON")
  r.add_argument("--json", default="", help="write the predictions here")
  r.add_argument("--rows", default=None,
                 help="comma-separated PREDICTIONS names ('' for the calibration only)")
  r.add_argument("--cache", default="", help="a folder caching compiled HLO")
  return p


def _check(args) -> None:
  if args.command == "census":
    if bool(args.config) == bool(args.hlo):
      raise errors.UserError("census needs --config or --hlo (one of them)")
    if args.gpu not in aot.TARGETS:
      raise errors.UserError(f"--gpu {args.gpu!r}: not one of {', '.join(aot.TARGETS)}")
    if args.micro is not None and args.micro < 1:
      raise errors.UserError(f"--micro {args.micro}: must be >= 1")
    if args.save and not args.name:
      raise errors.UserError("--save needs --name (the row's name in the census file)")
    if args.config:   # the config loads without a compiler: a bad one fails here, one line
      build.step_config(args.config, args.backend, args.set, args.micro)
  else:
    names = [p[0] for p in PREDICTIONS]
    bad = [n for n in (args.rows.split(",") if args.rows else []) if n not in names]
    if bad:
      raise errors.UserError(f"--rows {','.join(bad)}: not among {', '.join(names)}")
    if not cal.CALIBRATION.exists():
      raise errors.UserError(f"no calibration file {cal.CALIBRATION}")
  if getattr(args, "json", "") or getattr(args, "save", ""):
    path = getattr(args, "json", "") or args.save
    destinations.check_file(path, what="a step-model file", flag="--json/--save",
                            replaces=destinations.json_with_keys("format", "rows"))


def main(argv=None) -> int:
  args = _parser().parse_args(argv)   # argparse: a malformed command line exits 2
  args.argv = argv
  try:
    _check(args)
    return census(args) if args.command == "census" else report(args)
  except errors.UserError as e:
    print(f"s24jax.step_model: {e}", file=sys.stderr)
    return e.exit_code
