"""Step time of the paper-scale recipes on a GPU, dense against sparse, as a table with the
speed-up over dense (for docs/backends.md):

  python experiments/step_time.py                       # 124m and 350m, on the GPU it finds
  python experiments/step_time.py --variants 124m --steps 20 --json runs/step_time.json
  python experiments/step_time.py --variants tiny --allow-cpu   # a smoke run of the script

The rows are those of the GPU report's train-step section (s24jax/perf/gpu_report/steps.py, which
says how a step is timed): dense, Hu et al. and S-STE, each with sparsity.backend 'xla' and
'cusparselt'. `python -m s24jax.perf.gpu_report --sections steps` times the same steps, and the
step's anatomy, within a time budget. 'llama7b/2' runs the Llama recipes (steps.recipe_file).

Exit codes: 0 the table; 2 a bad argument (one line), or no GPU without --allow-cpu; 5 the
--json could not be written after the runs (the table printed above); 75 Ctrl-C, nothing
written. --json replaces only an earlier report of this script. Never run on a GPU in this
project (its 'tiny' smoke run on a CPU only).
"""
from __future__ import annotations

from s24jax.cli import command

NAME = "experiments/step_time.py"
if __name__ == "__main__":
  command.guard_startup(NAME)

# pylint: disable=wrong-import-position  (after the guard: Ctrl-C during imports is one line)
import json
import os
import sys

import jax

from s24jax import destinations
from s24jax import errors
from s24jax.cli import args
from s24jax.training import config as config_lib
from s24jax.perf.gpu_report import steps as steps_lib

import command_line  # pylint: disable=wrong-import-order  (experiments/, beside this file)

ROWS = (("dense", "xla"), ("hu2024", "xla"), ("hu2024", "cusparselt"), ("s_ste", "xla"),
        ("s_ste", "cusparselt"))
# steps.py's variants, and any GPT-2 variant of the experiment files as it is.
VARIANTS = tuple(dict.fromkeys((*steps_lib.VARIANTS, *config_lib.VARIANTS)))
a_report = destinations.json_with_keys("device", "jax", "rows")   # what --json writes


def main(argv=None) -> int:
  p = command.Parser(prog=NAME, description=__doc__.split("\n")[0])
  p.add_argument("--variants", default="124m,350m", type=command_line.names(VARIANTS, "variants"))
  p.add_argument("--steps", type=args.integer(minimum=1), default=10,
                 help="timed steps per round (default: %(default)s)")
  p.add_argument("--json", default=None, help="also write the rows here",
                 type=args.output_file("a step-time report", "--json", replaces=a_report))
  p.add_argument("--allow-cpu", action="store_true", help="run off a GPU (a smoke run)")
  parsed = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not parsed.allow_cpu:
    raise errors.UserError(f"no GPU here (jax.default_backend() = {jax.default_backend()!r}): "
                           "step times are only meaningful on one; --allow-cpu runs the "
                           "script anyway (a smoke run: --variants tiny)")
  device = jax.devices()[0].device_kind
  rows = []
  for variant in parsed.variants:
    config_variant, overrides = steps_lib.VARIANTS.get(variant, (variant, ()))
    dense = None
    for recipe, backend in ROWS:
      if backend == "cusparselt" and not on_gpu:
        continue
      r = {"variant": variant, "recipe": f"{recipe} {backend}", **steps_lib.step_seconds(
          steps_lib.recipe_file(variant, recipe), config_variant, backend, parsed.steps,
          overrides)}
      dense = dense or r["step_ms"]
      r["speedup_vs_dense"] = dense / r["step_ms"]
      rows.append(r)
      print(f"{variant:8s} {r['recipe']:20s} {r['step_ms']:9.2f} ms  "
            f"{r['tokens_per_sec']:10.0f} tok/s  x{r['speedup_vs_dense']:.3f} vs dense",
            flush=True)
  print(f"\n{device}, jax {jax.__version__}, one device, one micro-batch per step\n")
  print("| variant | recipe | micro-batch | step (ms) | tokens/s | vs dense |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['variant']} | {r['recipe']} | {r['micro_batch']} | {r['step_ms']:.2f} | "
          f"{r['tokens_per_sec']:.0f} | {r['speedup_vs_dense']:.3f}x |")
  if parsed.json:
    with destinations.writing(f"the report {parsed.json}", "The table above holds the rows; "
                              "the file is as it was"):
      os.makedirs(os.path.dirname(os.path.abspath(parsed.json)), exist_ok=True)
      destinations.write_atomic(parsed.json, json.dumps(
          {"device": device, "jax": jax.__version__, "rows": rows}, indent=2),
          replaces=a_report, what="a step-time report")
  return 0


if __name__ == "__main__":
  from s24jax.kernels import aot   # pylint: disable=g-import-not-at-top
  aot.cpu_unless_gpu()
  command.exit_with(command.run(main, name=NAME))
