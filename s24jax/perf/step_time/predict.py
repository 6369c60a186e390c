"""The step model's predictions file (`python -m s24jax.perf.step_time predict --out FILE`): the
rows of PREDICTIONS (or one config) compiled from the current code, each timed by every
device's model fitted to the calibration (validation.fit_all).

The file is a function of its inputs alone: the code (its digests), the calibration file and
the run files the fit reads (their sha256), and the command's row selection; no date, no git
state. The same inputs give the same bytes; any other calibration gives other constants.
"""
from __future__ import annotations

import hashlib
import pathlib
from typing import Any

from s24jax.perf import roofline
from s24jax.perf.step_time import build
from s24jax.perf.step_time import calibration as cal
from s24jax.perf.step_time import validation

FORMAT = "s24jax.step_model_predictions/2"
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
# The first three are the GPU report's step rows (s24jax/perf/gpu_report/steps.py: one device,
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
COMPILE_GPU = "h100"   # every device's prediction times this compile (module docstring)


def wanted(rows: str | None) -> list[tuple[str, str, str, tuple[str, ...], int | None]]:
  """(name, config spec, backend, overrides, micro) of the PREDICTIONS rows named in `rows`
  (comma-separated; None: all) on every arm."""
  names = None if rows is None else rows.split(",")
  return [(name, f"{cal.REPO / RECIPES[family][recipe]}:{variant}", backend, overrides, micro)
          for name, family, variant, overrides, micro in PREDICTIONS
          if names is None or name in names for recipe, backend in ARMS]


def _sha256(path: pathlib.Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def _relative(path: pathlib.Path) -> str:
  path = path.resolve()
  return str(path.relative_to(cal.REPO)) if path.is_relative_to(cal.REPO) else str(path)


def inputs(calibration_path, fits: dict[str, validation.DeviceFit]) -> dict[str, Any]:
  """What the file is a function of: files by sha256, code by digest (build.source_digest)."""
  import jax   # pylint: disable=g-import-not-at-top
  files = [pathlib.Path(calibration_path)]
  for fit in fits.values():
    for run in fit.runs:
      files += cal.run_files(run.path)
  return {"files": {_relative(p): _sha256(p) for p in files},
          "step_source": build.source_digest(step=True),
          "model_source": build.source_digest(step=False), "jax": jax.__version__,
          "compiled_for": COMPILE_GPU}


def predict(name: str, spec: str, backend: str, overrides, micro,
            fits: dict[str, validation.DeviceFit], cache=None) -> list[dict[str, Any]]:
  """One compiled step, one row per device (its step_ms None where the device's cuSPARSELt
  table lacks a GEMM the step calls: `missing`)."""
  config, kernels, memory = build.compile_census(spec, backend, overrides, micro, COMPILE_GPU,
                                                 cache)
  tokens = int(config.batch_size) * int(config.model.seq_len)
  shared = {"name": name, "variant": name if name in GPU_REPORT_ROWS else None,
            "recipe": _recipe(spec), "backend": backend,
            "gemm_choice": config.sparsity.get("gemm_choice") if backend == "cusparselt" else None,
            "micro_batch": int(config.batch_size), "seq_len": int(config.model.seq_len),
            "num_layers": int(config.model.num_layers), "d_model": int(config.model.d_model),
            "launches": sum(k.count for k in kernels if not k.branch),
            "compiled_gib": memory["total_bytes"] / 2**30}
  out = []
  for device, fit in fits.items():
    try:
      seconds = fit.step_seconds(kernels)
      by_category = roofline.by_category(kernels, fit.constants, fit.table)
    except roofline.MissingGemm as e:
      out.append({**shared, "device": device, "step_ms": None, "missing": str(e).strip("'\"")})
      continue
    out.append({**shared, "device": device, "step_ms": 1e3 * seconds,
                "tokens_per_sec": tokens / seconds,
                "ms_by_category": {k: 1e3 * v for k, v in by_category.items() if v}})
  return out


def _recipe(spec: str) -> str:
  """The recipe of a config spec: its RECIPES name, else the file's stem."""
  path = spec.rsplit(":", 1)[0]
  for family in RECIPES.values():
    for recipe, file in family.items():
      if path.endswith(file):
        return recipe
  return pathlib.Path(path).stem


def document(fits: dict[str, validation.DeviceFit], rows: list[dict[str, Any]],
             calibration_path, command: str) -> dict[str, Any]:
  return {"format": FORMAT,
          "what": ("PREDICTIONS of the s24jax step-time model (s24jax/perf/roofline.py), not "
                   "measurements: train-step milliseconds on each device the model was fitted "
                   "on, from deviceless compiles for an " + COMPILE_GPU.upper() + " of the "
                   "code `inputs` names, with constants fitted per device to its measured rows "
                   "(`devices`: in-sample and leave-one-out errors, Kendall's tau)"),
          "command": command, "inputs": inputs(calibration_path, fits),
          "devices": {d: validation.device_json(f) for d, f in fits.items()}, "rows": rows}
