"""The measured GPU runs the step model is calibrated on (RUNS: each run's step times and
cuSPARSELt GEMM rows, read from its raw files in docs/gpu_runs/), and saved censuses of the
code that ran there (the calibration file, `CALIBRATION`: one census per measured row, named
'<run folder>/<row>')."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from s24jax import errors
from s24jax.perf import outputs
from s24jax.perf import roofline
from s24jax.perf import step_census

REPO = pathlib.Path(__file__).resolve().parents[3]
RUNS_DIR = REPO / "docs" / "gpu_runs"
CALIBRATION = REPO / "docs" / "step_model_calibration.json"
CENSUS_FORMAT = "s24jax.step_census/1"   # the format's name (data: kept since 0.3)
# A run's files the model reads: the GPU report's rows (steps, GEMMs) as JSON lines, and the
# per-GEMM times measured at first use (sparse_ops/gemm_times.py's format).
ROW_FILES, GEMM_TIME_FILES = "*.jsonl", "gemm_times*.json"


@dataclasses.dataclass(frozen=True)
class Run:
  """A GPU run (its folder in RUNS_DIR) and its device's peaks: the fit's upper bounds
  (roofline.bounds)."""
  folder: str
  device: str
  peak_flops_per_s: float    # dense bf16
  peak_bytes_per_s: float    # memory

  @property
  def path(self) -> pathlib.Path:
    return RUNS_DIR / self.folder


# The H100 SXM: 989 TFLOP/s bf16, 3.35 TB/s (HBM3); the H200: the same tensor cores, 4.8 TB/s
# (HBM3e). One run per device so far; runs of one device are fitted together.
RUNS = (Run("h100-2026-11-27", "NVIDIA H100 80GB HBM3", 989e12, 3.35e12),
        Run("h200-2026-11-27", "NVIDIA H200", 989e12, 4.8e12))


@dataclasses.dataclass(frozen=True)
class Measured:
  """A measured step (its census and the mean of its timings) and the run that timed it."""
  run: Run
  row: roofline.Row          # name: the run's row name
  times_ms: tuple[float, ...]


def kernel_record(k: step_census.Kernel) -> dict[str, Any]:
  keep = ("category", "count", "flops", "bytes", "operand_bytes", "fp8_gemm", "target",
          "branch", "trips_known")
  out = {f: getattr(k, f) for f in keep}
  if k.target.startswith("cusparselt"):   # what roofline reads of a cuSPARSELt call
    out.update(op_name=k.op_name, attributes=k.attributes, gemm_mnk=k.gemm_mnk)
  return out


def kernel_from_record(r: dict[str, Any]) -> step_census.Kernel:
  fields = {f.name for f in dataclasses.fields(step_census.Kernel)}
  r = {k: v for k, v in r.items() if k in fields}
  r.setdefault("op_name", "")
  if r.get("gemm_mnk") is not None:
    r["gemm_mnk"] = tuple(r["gemm_mnk"])
  return step_census.Kernel(name="", opcode="", **r)


def compact(kernels) -> list[dict[str, Any]]:
  """Kernel records, identical ones merged (their counts summed)."""
  merged: dict[str, dict[str, Any]] = {}
  for k in kernels:
    rec = kernel_record(k)
    key = json.dumps({f: v for f, v in rec.items() if f != "count"}, sort_keys=True)
    if key in merged:
      merged[key]["count"] += rec["count"]
    else:
      merged[key] = rec
  return list(merged.values())


def not_a_census(path) -> str | None:
  """None if `path` is a census file (CENSUS_FORMAT), else why not (args.input_file's
  `kind`)."""
  try:
    data = json.loads(pathlib.Path(path).read_bytes().decode("utf-8"))
  except (OSError, ValueError) as e:   # a binary file: UnicodeDecodeError, a ValueError
    return f"not JSON ({str(e).splitlines()[0][:80]})"
  if not (isinstance(data, dict) and data.get("format") == CENSUS_FORMAT
          and isinstance(data.get("rows"), dict)):
    return f'not a JSON object with "format": "{CENSUS_FORMAT}" and its "rows"'
  return None


def load_calibration(path=CALIBRATION) -> dict[str, dict[str, Any]]:
  why = not_a_census(path)
  if why:
    raise errors.UserError(f"{path}: not a census file: {why}")
  return json.loads(pathlib.Path(path).read_bytes())["rows"]


def save_census(path: str, name: str, row: dict[str, Any]) -> None:
  """Adds (or replaces) the row `name` of a census file, one kernel record per line; a file
  there must be a census file (it is left as it is otherwise), a missing folder is made."""
  p = pathlib.Path(path)
  data = (json.loads(p.read_text()) if p.exists() and not not_a_census(p)
          else {"format": CENSUS_FORMAT, "rows": {}})
  data["rows"][name] = row
  outputs.write(path, dump_census(data), what="the census file",
                replaces=lambda q: not not_a_census(q),
                intact="The census file is as it was (the table above is complete)")


def dump_census(data: dict[str, Any]) -> str:
  head = {k: v for k, v in data.items() if k != "rows"}
  rows = []
  for name, row in data["rows"].items():
    fields = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in row.items() if k != "kernels"]
    kernels = ",\n".join(f"   {json.dumps(k)}" for k in row.get("kernels", []))
    rows.append(f" {json.dumps(name)}: {{\n" + ",\n".join(fields) +
                f',\n  "kernels": [\n{kernels}]}}')
  return (json.dumps(head, indent=1)[:-2] + ',\n "rows": {\n' + ",\n".join(rows) + "}}\n")


def _jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ok(record: dict[str, Any]) -> bool:
  return record.get("status", "ok") == "ok"


def row_name(record: dict[str, Any]) -> str:
  """A step row's name: the GPU report's `row`, else (the H100 run's files) its fields."""
  choice = record.get("gemm_choice")
  return record.get("row") or (f"{record['variant']} {record['recipe']} {record['backend']}" +
                               (f" gemm_choice={choice}" if choice else ""))


def measured_steps(run: pathlib.Path) -> dict[str, list[float]]:
  """Row name -> the step times (ms) of every finished step row in the run's *.jsonl files
  (the GPU report's rows: `step_ms`), in the order the rows first appear."""
  out: dict[str, list[float]] = {}
  for path in sorted(run.glob(ROW_FILES)):
    for record in _jsonl(path):
      if "step_ms" in record and _ok(record):
        out.setdefault(row_name(record), []).append(float(record["step_ms"]))
  return out


def sparse_table(run: pathlib.Path) -> roofline.SparseTable:
  """The run's measured cuSPARSELt GEMMs as the library's M, N, K per GEMM
  (s24jax/sparse_ops/cusparselt.py: forward (N, T, K), dgrad (K, T, N), wgrad (N, K, T) for
  W~ (N, K) at T tokens), from the GPU report's GEMM rows (*.jsonl: `shape_NK`, `ms`) and
  the per-GEMM times measured at first use (gemm_times*.json, sparse_ops/gemm_times.py).
  GEMM rows without `calls_per_loop` are single calls timed on the host (the H100 run's,
  c9f697b), whose `dense_xla` is the bf16 product for the FP8 rows too; the others, and the
  first-use times, are a jitted loop's mean."""
  gemms = []
  for path in sorted(run.glob(ROW_FILES)):
    for row in _jsonl(path):
      if "shape_NK" not in row or "ms" not in row or not _ok(row):
        continue
      (n, k), t = row["shape_NK"], row["tokens"]
      shapes = {"forward": (n, t, k), "dgrad": (k, t, n), "wgrad": (n, k, t)}
      for kind in roofline.GEMM_KINDS:
        ms = row["ms"][kind]
        gemms.append(roofline.SparseGemm(
            kind, row["precision"], *shapes[kind], ms["sparse"],
            ms["sparse+compress"] - ms["sparse"], ms["dense_xla"],
            host_timed="calls_per_loop" not in row))
  for path in sorted(run.glob(GEMM_TIME_FILES)):
    for r in json.loads(path.read_text())["rows"]:
      precision = "bf16" if r["a_type"] == "bf16" else "fp8"
      gemms.append(roofline.SparseGemm(r["gemm"], precision, r["m"], r["n"], r["k"],
                                       r["sparse_ms"], r["compress_ms"], r["dense_ms"],
                                       dense_precision=precision, host_timed=False))
  return roofline.SparseTable(tuple(gemms))


def run_files(run: pathlib.Path) -> list[pathlib.Path]:
  """Every file of the run that measured_steps and sparse_table read."""
  return sorted([*run.glob(ROW_FILES), *run.glob(GEMM_TIME_FILES)])


def _order(name: str) -> tuple:
  """Rows of a variant together: dense, Hu et al., S-STE; 'xla' before 'cusparselt'."""
  rank = {"dense": 0, "hu2024": 1, "s_ste": 2, "xla": 0, "cusparselt": 1}
  variant, recipe, backend, *rest = name.split() + ["", ""]
  return (variant, rank.get(recipe, 9), recipe, rank.get(backend, 9), backend, *rest)


def calibration_rows(calibration: dict[str, dict[str, Any]], source: str = CALIBRATION.name,
                     runs=RUNS) -> list[Measured]:
  """Every measured step of the runs with its census (calibration key '<run>/<row>'); a
  measured row without a census, or a census of no measured row, is an error."""
  rows, keys = [], set()
  for run in runs:
    measured = measured_steps(run.path)
    for name in sorted(measured, key=_order):
      key = f"{run.folder}/{name}"
      keys.add(key)
      if key not in calibration:
        raise errors.UserError(f"{source} has no census of the measured row {key!r}")
      kernels = tuple(kernel_from_record(r) for r in calibration[key]["kernels"])
      times = tuple(measured[name])
      rows.append(Measured(run, roofline.Row(name, kernels, sum(times) / len(times) / 1e3),
                           times))
  extra = sorted(set(calibration) - keys)
  if extra:
    raise errors.UserError(f"{source}: censuses of no measured row: {', '.join(extra)} "
                           f"(names are '<run>/<row>', runs {', '.join(r.folder for r in runs)})")
  return rows
