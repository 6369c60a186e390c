"""Measured times of the sparse GEMMs, for sparsity.gemm_choice (gemm_choice.py): the key a
GEMM's times are filed under, the table file and this machine's cache of measurements (one
format), and timing a GEMM on the device.

TABLE_FORMAT (the table file and the cache are the same JSON):

  {"format": "s24jax.gemm_times/1", "rows": [
    {"device_kind": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
     "library": "cusparselt", "library_version": "0.8.0", "jax": "0.11.2", "jaxlib": "0.11.2",
     "gemm": "forward", "m": 3072, "n": 8192, "k": 768, "layout": "TN", "d_order": "col",
     "a_type": "bf16", "b_type": "bf16", "d_type": "bf16",
     "sparse_ms": 0.317, "compress_ms": 0.019, "dense_ms": 0.159, "source": "..."}]}

A row's key fields (KEY_FIELDS, those of `Key`: the device, the library and JAX versions, and
the GEMM as the library runs it, like the keys of XLA's autotuning results) select the GEMMs it
describes: a field it leaves out matches any value (a hand-written row may leave out the JAX
versions), but 'gemm', 'm', 'n' and 'k' are required; where several rows match, the one with
the most key fields wins, then the first. Its times (TIME_FIELDS, milliseconds per call):
'sparse_ms' the 2:4 kernel on its compressed operand, 'compress_ms' one compression of that
operand (FP8: with its quantization), 'dense_ms' the dense XLA GEMM that runs instead; 'source'
and 'note' are free text (where and when it was measured). Any other field is an error, so a
misspelt key cannot silently match everything. An example, seeded from the first H100 run:
experiments/gemm_tables/h100-2026-11-27.json.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import threading
from typing import Any, Callable

from absl import logging
import jax
import jaxlib

from s24jax.kernels import timing

# The GEMMs of a sparse layer (sparse_ops/__init__.py): y = x W~^T, dX = dY W~, dW~ = est(dY^T) x.
KINDS = ("forward", "dgrad", "wgrad")
TABLE_FORMAT = "s24jax.gemm_times/1"
# Key fields that a table row must give (the GEMM's kind and shape).
REQUIRED_FIELDS = ("gemm", "m", "n", "k")
TIME_FIELDS = ("sparse_ms", "compress_ms", "dense_ms")
FREE_FIELDS = ("source", "note")
# The on-device measurement: CALLS calls per jitted loop, the median of REPS loops.
CALLS = 20
REPS = 5
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Key:
  """What a GEMM's times depend on: the device, the library and JAX versions, and the GEMM as
  the library runs it (kind, m x n x k, layout of op(A) op(B) as 'TN' / 'NN' / 'TT', the
  order of D, the operand and output types in the library's names)."""
  device_kind: str
  compute_capability: str
  library: str
  library_version: str
  jax: str
  jaxlib: str
  gemm: str
  m: int
  n: int
  k: int
  layout: str
  d_order: str
  a_type: str
  b_type: str
  d_type: str

  def row(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


KEY_FIELDS = tuple(f.name for f in dataclasses.fields(Key))


@dataclasses.dataclass(frozen=True)
class Times:
  """Milliseconds per call of one GEMM (TIME_FIELDS) and where they come from."""
  sparse_ms: float
  compress_ms: float
  dense_ms: float
  source: str

  def sparse_cost_ms(self, compress_share: float) -> float:
    """The 2:4 GEMM per call with its share of the compression (module docstring)."""
    return self.sparse_ms + compress_share * self.compress_ms


# ---------------------------------------------------------------------------------------------
# Tables: the file sparsity.gemm_table and the cache (the same format).


def _fail(path, what: str):
  raise ValueError(f"sparsity.gemm_table {str(path)!r}: {what} (format: s24jax/sparse_ops/"
                   "gemm_choice.py, TABLE_FORMAT)")


def parse_rows(data: Any, path) -> list[dict]:
  """The rows of a table's JSON, checked (ValueError naming the file and the row)."""
  if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
    _fail(path, f"not a JSON object with \"format\": \"{TABLE_FORMAT}\"")
  rows = data.get("rows")
  if not isinstance(rows, list):
    _fail(path, "no \"rows\" list")
  ints = ("m", "n", "k")
  for i, row in enumerate(rows):
    if not isinstance(row, dict):
      _fail(path, f"row {i} is not an object")
    unknown = sorted(set(row) - set(KEY_FIELDS + TIME_FIELDS + FREE_FIELDS))
    missing = [f for f in REQUIRED_FIELDS + TIME_FIELDS if f not in row]
    if unknown or missing:
      _fail(path, f"row {i}: " + "; ".join(
          ([f"unknown field(s) {', '.join(unknown)}"] if unknown else [])
          + ([f"missing {', '.join(missing)}"] if missing else [])))
    for f in (f for f in KEY_FIELDS if f in row):
      ok = (isinstance(row[f], int) and not isinstance(row[f], bool) if f in ints
            else isinstance(row[f], str))
      if not ok:
        _fail(path, f"row {i}: {f} must be {'an integer' if f in ints else 'a string'}, "
                    f"not {row[f]!r}")
    if row["gemm"] not in KINDS:
      _fail(path, f"row {i}: gemm {row['gemm']!r} is not one of {', '.join(KINDS)}")
    for f in TIME_FIELDS:
      if isinstance(row[f], bool) or not isinstance(row[f], (int, float)) or row[f] < 0:
        _fail(path, f"row {i}: {f} must be a number >= 0 (milliseconds), not {row[f]!r}")
  return rows


_TABLES: dict[tuple[str, float], list[dict]] = {}


def load_table(path: str) -> list[dict]:
  """The checked rows of the table file at `path` (re-read when it changes)."""
  try:
    mtime = os.path.getmtime(path)
  except OSError as e:
    _fail(path, f"cannot be read ({e.strerror})")
  if (path, mtime) not in _TABLES:
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
    except (OSError, ValueError) as e:
      _fail(path, f"not readable as JSON ({str(e).splitlines()[0]})")
    _TABLES[(path, mtime)] = parse_rows(data, path)
  return _TABLES[(path, mtime)]


def lookup(rows: list[dict], key: Key) -> dict | None:
  """The row describing `key`: every key field it gives equal, the most such fields, then
  the first (module docstring)."""
  want = key.row()
  best, best_fields = None, -1
  for row in rows:
    given = [f for f in KEY_FIELDS if f in row]
    if all(row[f] == want[f] for f in given) and len(given) > best_fields:
      best, best_fields = row, len(given)
  return best


def cache_file() -> pathlib.Path:
  """The measurements of this machine: the s24jax cache ($S24JAX_CACHE, else
  ~/.cache/s24jax) / gemm_choice / times.json."""
  base = os.environ.get("S24JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                        "s24jax")
  return pathlib.Path(base) / "gemm_choice" / "times.json"


def _cache_rows(path: pathlib.Path) -> list[dict]:
  """The cache's rows; an unreadable cache is said and treated as empty (it is only ours)."""
  if not path.exists():
    return []
  try:
    return parse_rows(json.loads(path.read_text(encoding="utf-8")), path)
  except (OSError, ValueError) as e:
    logging.warning("ignoring the GEMM measurement cache %s: %s", path, e)
    return []


def store(key: Key, times: Times) -> None:
  """Adds (or replaces) the measurement of `key` in the cache, atomically (a temporary file
  renamed: a concurrent reader sees the old file or the new one)."""
  path = cache_file()
  with _LOCK:
    rows = [r for r in _cache_rows(path) if any(r.get(f) != v for f, v in key.row().items())]
    rows.append({**key.row(), "sparse_ms": times.sparse_ms, "compress_ms": times.compress_ms,
                 "dense_ms": times.dense_ms, "source": times.source})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": TABLE_FORMAT, "rows": rows}, indent=1),
                   encoding="utf-8")
    os.replace(tmp, path)


def _times(row: dict, source: str) -> Times:
  where = f"{source} ({row['source']})" if row.get("source") else source
  return Times(float(row["sparse_ms"]), float(row["compress_ms"]), float(row["dense_ms"]),
               where)


def find_times(table: str, key: Key) -> Times | None:
  """The times of `key` from the table file `table` (if any), else from the cache."""
  if table:
    row = lookup(load_table(table), key)
    if row is not None:
      return _times(row, f"table {table}")
  row = lookup(_cache_rows(cache_file()), key)
  return None if row is None else _times(row, f"cache {cache_file()}")


# ---------------------------------------------------------------------------------------------
# The device, and measuring on it.


def device_fields(dev) -> dict[str, str]:
  """The device's key fields: its kind and compute capability ('none' off a GPU)."""
  cc = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
  return {"device_kind": str(dev.device_kind), "compute_capability": str(cc or "none")}


def versions() -> dict[str, str]:
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def can_measure(dev) -> bool:
  """Whether GEMMs can be timed on `dev`: a GPU of this process (not a compile-only one)."""
  if dev.platform != "gpu":
    return False
  try:
    return dev in jax.devices("gpu")
  except RuntimeError:   # no GPU backend: a deviceless compile
    return False


def outside_trace(fn: Callable[[], Any]) -> Any:
  """fn() in a fresh thread, so that its jitted calls run rather than join the trace (and
  the mesh context) of the step being built here; JAX keeps those per thread."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(fn).result()


def per_call_ms(fn: Callable[..., jax.Array], *args, calls: int = CALLS,
                reps: int = REPS) -> float:
  """Milliseconds per call of fn(*args), timed as `calls` calls inside one jitted loop (the
  median of `reps` loops, after one to compile): kernels.timing.loop_seconds, whose calls
  take arguments that vary from call to call, so that XLA cannot hoist the call out of the
  loop (an optimization barrier alone does not stop it: XLA drops barriers before it hoists
  loop-invariant work, seen in the CPU HLO)."""
  return 1e3 * timing.loop_seconds(fn, *args, calls=calls, repeats=reps)
