"""The measured run the step model is calibrated on, and saved censuses of the code that ran
there (the calibration file, `CALIBRATION`)."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from s24jax import destinations
from s24jax import errors
from s24jax import roofline
from s24jax import step_census

REPO = pathlib.Path(__file__).resolve().parents[2]
RUN = REPO / "docs" / "gpu_runs" / "h100-2026-11-27"
RUN_DEVICE = "NVIDIA H100 80GB HBM3"
RUN_DATE = "2026-11-27"
CALIBRATION = REPO / "docs" / "step_model_calibration.json"
CENSUS_FORMAT = "s24jax.step_census/1"


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


def load_calibration(path=CALIBRATION) -> dict[str, dict[str, Any]]:
  data = json.loads(pathlib.Path(path).read_text())
  if data.get("format") != CENSUS_FORMAT:
    raise errors.UserError(f"{path}: not a census file (format {CENSUS_FORMAT})")
  return data["rows"]


def save_census(path: str, name: str, row: dict[str, Any]) -> None:
  """Adds (or replaces) the row `name` of a census file, one kernel record per line."""
  p = pathlib.Path(path)
  data = (json.loads(p.read_text()) if p.exists() else {"format": CENSUS_FORMAT, "rows": {}})
  data["rows"][name] = row
  destinations.write_atomic(path, dump_census(data))


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


def measured_steps(run: pathlib.Path = RUN) -> dict[tuple[str, str], list[float]]:
  """(recipe, backend) -> the 124M step times (ms) of the run's step rows that finished."""
  out: dict[tuple[str, str], list[float]] = {}
  for path in sorted(run.glob("step_times_run*.jsonl")):
    for row in _jsonl(path):
      if row.get("variant") == "124m" and "step_ms" in row:
        out.setdefault((row["recipe"], row["backend"]), []).append(float(row["step_ms"]))
  return out


def sparse_table(run: pathlib.Path = RUN) -> roofline.SparseTable:
  """The run's cuSPARSELt GEMM rows (gemms_run2.jsonl) as the library's M, N, K per GEMM
  (s24jax/sparse_ops/cusparselt.py: forward (N, T, K), dgrad (K, T, N), wgrad (N, K, T) for
  W~ (N, K) at T tokens). Its `dense_xla` is the bf16 product for the FP8 rows too (c9f697b's
  gpu_report timed `x @ W~^T` in bf16 for both)."""
  gemms = []
  for row in _jsonl(run / "gemms_run2.jsonl"):
    (n, k), t = row["shape_NK"], row["tokens"]
    shapes = {"forward": (n, t, k), "dgrad": (k, t, n), "wgrad": (n, k, t)}
    for kind in roofline.GEMM_KINDS:
      ms = row["ms"][kind]
      gemms.append(roofline.SparseGemm(kind, row["precision"], *shapes[kind], ms["sparse"],
                                       ms["sparse+compress"] - ms["sparse"], ms["dense_xla"]))
  return roofline.SparseTable(tuple(gemms))


def calibration_rows(calibration: dict[str, dict[str, Any]],
                     measured: dict[tuple[str, str], list[float]]) -> list[roofline.Row]:
  rows = []
  order = {"dense": 0, "hu2024": 1, "s_ste": 2, "xla": 0, "cusparselt": 1}
  for (recipe, backend), times in sorted(measured.items(),
                                         key=lambda kv: (order.get(kv[0][0], 9), kv[0][0],
                                                         order.get(kv[0][1], 9), kv[0][1])):
    name = f"124m {recipe} {backend}"
    if name not in calibration:
      raise errors.UserError(f"{CALIBRATION.name} has no census of the measured row {name!r}")
    kernels = tuple(kernel_from_record(r) for r in calibration[name]["kernels"])
    rows.append(roofline.Row(name, kernels, sum(times) / len(times) / 1e3))
  return rows
