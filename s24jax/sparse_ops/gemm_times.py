"""Measured times of the sparse GEMMs, for sparsity.gemm_choice (gemm_choice.py): the key a
GEMM's times are filed under, the table file and this machine's cache of measurements (one
format), and timing a GEMM on the device.

TABLE_FORMAT (the table file and the cache are the same JSON; a file of the older format
's24jax.gemm_times/1' is read too, with the fields it had: every one below but those marked /2):

  {"format": "s24jax.gemm_times/2", "rows": [
    {"device_kind": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "driver": "12.8",
     "library": "cusparselt", "library_version": "0.8.0", "jax": "0.11.2", "jaxlib": "0.11.2",
     "gemm_code": "0123456789ab",
     "gemm": "forward", "m": 3072, "n": 8192, "k": 768, "layout": "TN", "d_order": "col",
     "a_type": "bf16", "b_type": "bf16", "d_type": "bf16",
     "sparse_ms": 0.317, "compress_ms": 0.019, "dense_ms": 0.159,
     "sparse_spread_ms": 0.004, "compress_spread_ms": 0.001, "dense_spread_ms": 0.002,
     "alg_id": 0, "split_k": 1, "split_k_mode": 0, "split_k_buffers": 1, "source": "..."}]}

Key fields (KEY_FIELDS, those of `Key`), like the keys of XLA's autotuning results: the device
(kind, compute capability, `driver`: the CUDA version its driver reports, /2), the library and
its version as loaded, the JAX versions, `gemm_code` (/2: a hash of s24jax's files whose change
can change a GEMM's time or result, `gemm_code_version`), and the GEMM as the library runs it.
A table row's key fields select the GEMMs it describes: a field it leaves out matches any
value (a hand-written row may leave out the versions), but 'gemm', 'm', 'n' and 'k' are
required; where several rows match, the one with the most key fields wins, then the first.
The cache, written here with every key field, is searched only among its rows that give them
all: a measurement of other GEMM code, another driver or library is measured again.

Times, milliseconds per call, finite and >= 0 (TIME_FIELDS, required): 'sparse_ms' the 2:4
kernel on its compressed operand, 'compress_ms' one compression of that operand (FP8: with its
quantization), 'dense_ms' the dense XLA GEMM that runs instead. Optional (/2): their spreads
(SPREAD_FIELDS: max - min over the REPS timed loops; 0 where left out), which gemm_choice.py
requires the 2:4 kernel to beat the dense GEMM by, and the algorithm the library chose for the
GEMM (ALGORITHM_FIELDS, integers, all four or none). 'source' and 'note' are free text. Any
other field is an error, so a misspelt key cannot silently match everything. An example,
seeded from the first H100 run: experiments/gemm_tables/h100-2026-11-27.json.

The cache (`cache_file`) is shared by the processes of the machine: `store` holds an exclusive
lock (flock of a file beside it) while it re-reads the cache, merges its row in and replaces
the file (destinations.write_atomic: synced, then renamed), so concurrent measurements are all
kept and a reader sees a whole file. Never run on a GPU: the driver's version (libcuda), the
spreads and the algorithm measured there.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import os
import pathlib
import statistics
import threading
from typing import Any, Callable

from absl import logging
import jax
import jaxlib

from s24jax import destinations
from s24jax.kernels import timing

# The GEMMs of a sparse layer (sparse_ops/__init__.py): y = x W~^T, dX = dY W~, dW~ = est(dY^T) x.
KINDS = ("forward", "dgrad", "wgrad")
# The formats read, oldest first; the last one is written.
FORMATS = ("s24jax.gemm_times/1", "s24jax.gemm_times/2")
TABLE_FORMAT = FORMATS[-1]
# Key fields that a table row must give (the GEMM's kind and shape).
REQUIRED_FIELDS = ("gemm", "m", "n", "k")
TIME_FIELDS = ("sparse_ms", "compress_ms", "dense_ms")
SPREAD_FIELDS = ("sparse_spread_ms", "compress_spread_ms", "dense_spread_ms")
# The library's algorithm for the GEMM (cuSPARSELt: its matmul algorithm's id and split-K).
ALGORITHM_FIELDS = ("alg_id", "split_k", "split_k_mode", "split_k_buffers")
FREE_FIELDS = ("source", "note")
# Row fields that FORMATS[0] did not have.
NEW_IN_2 = ("driver", "gemm_code") + SPREAD_FIELDS + ALGORITHM_FIELDS
# The on-device measurement: CALLS calls per jitted loop, REPS loops (their median, spread).
CALLS = 20
REPS = 5
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Key:
  """What a GEMM's times depend on: the device and its driver, the library, JAX and s24jax's
  GEMM code versions, and the GEMM as the library runs it (kind, m x n x k, layout of op(A)
  op(B) as 'TN' / 'NN' / 'TT', the order of D, the operand and output types in the library's
  names)."""
  device_kind: str
  compute_capability: str
  driver: str
  library: str
  library_version: str
  jax: str
  jaxlib: str
  gemm_code: str
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
  """Milliseconds per call of one GEMM (TIME_FIELDS), where they come from, their spreads
  (SPREAD_FIELDS; 0: not known) and the library's algorithm (ALGORITHM_FIELDS; None: not
  known)."""
  sparse_ms: float
  compress_ms: float
  dense_ms: float
  source: str
  sparse_spread_ms: float = 0.0
  compress_spread_ms: float = 0.0
  dense_spread_ms: float = 0.0
  algorithm: tuple[int, int, int, int] | None = None

  def sparse_cost_ms(self, compress_share: float) -> float:
    """The 2:4 GEMM per call with its share of the compression (gemm_choice.py)."""
    return self.sparse_ms + compress_share * self.compress_ms

  def margin_ms(self, compress_share: float) -> float:
    """How much the measurements of `sparse_cost_ms` and of the dense GEMM may be off: the
    sum of their spreads."""
    return (self.sparse_spread_ms + compress_share * self.compress_spread_ms
            + self.dense_spread_ms)

  def row(self) -> dict[str, Any]:
    """The row fields of these times (the algorithm's only where known)."""
    row = {f: getattr(self, f) for f in (*TIME_FIELDS, "source", *SPREAD_FIELDS)}
    if self.algorithm is not None:
      row.update(zip(ALGORITHM_FIELDS, self.algorithm))
    return row


# ---------------------------------------------------------------------------------------------
# Tables: the file sparsity.gemm_table and the cache (the same format).


def _fail(path, what: str):
  # The file by its role: the table the config names, or this machine's cache (same format).
  role = ("the GEMM time cache" if os.path.abspath(path) == os.path.abspath(cache_file())
          else "sparsity.gemm_table")
  raise ValueError(f"{role} {str(path)!r}: {what} (format: s24jax/sparse_ops/"
                   "gemm_times.py, TABLE_FORMAT)")


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_ms(v) -> bool:
  """A time in milliseconds: a finite number >= 0 (JSON's NaN and Infinity are not)."""
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _check_row(row: dict, i: int, fmt: str, path) -> None:
  too_new = set(NEW_IN_2) if fmt == FORMATS[0] else set()
  allowed = set(KEY_FIELDS + TIME_FIELDS + SPREAD_FIELDS + ALGORITHM_FIELDS + FREE_FIELDS)
  unknown = sorted(set(row) - (allowed - too_new))
  missing = [f for f in REQUIRED_FIELDS + TIME_FIELDS if f not in row]
  if unknown or missing:
    later = (f" (those of {', '.join(NEW_IN_2)} need \"format\": \"{TABLE_FORMAT}\")"
             if too_new & set(unknown) else "")
    _fail(path, f"row {i}: " + "; ".join(
        ([f"unknown field(s) {', '.join(unknown)}{later}"] if unknown else [])
        + ([f"missing {', '.join(missing)}"] if missing else [])))
  for f in (f for f in KEY_FIELDS if f in row):
    ints = f in ("m", "n", "k")
    if not (_is_int(row[f]) if ints else isinstance(row[f], str)):
      _fail(path, f"row {i}: {f} must be {'an integer' if ints else 'a string'}, "
                  f"not {row[f]!r}")
  if row["gemm"] not in KINDS:
    _fail(path, f"row {i}: gemm {row['gemm']!r} is not one of {', '.join(KINDS)}")
  for f in (f for f in TIME_FIELDS + SPREAD_FIELDS if f in row):
    if not _is_ms(row[f]):
      _fail(path, f"row {i}: {f} must be a finite number >= 0 (milliseconds), not {row[f]!r}")
  given = [f for f in ALGORITHM_FIELDS if f in row]
  if given and (len(given) < len(ALGORITHM_FIELDS) or not all(_is_int(row[f]) for f in given)):
    _fail(path, f"row {i}: {', '.join(ALGORITHM_FIELDS)} must be integers, all four or none, "
                f"not {', '.join(f'{f}={row[f]!r}' for f in given)}")


def parse_rows(data: Any, path) -> list[dict]:
  """The rows of a table's JSON, checked (ValueError naming the file and the row)."""
  if not isinstance(data, dict) or data.get("format") not in FORMATS:
    _fail(path, "not a JSON object with \"format\": " + " or ".join(f'"{f}"' for f in FORMATS))
  rows = data.get("rows")
  if not isinstance(rows, list):
    _fail(path, "no \"rows\" list")
  for i, row in enumerate(rows):
    if not isinstance(row, dict):
      _fail(path, f"row {i} is not an object")
    _check_row(row, i, data["format"], path)
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


def lookup(rows: list[dict], key: Key, *, complete: bool = False) -> dict | None:
  """The row describing `key`: every key field it gives equal, the most such fields, then
  the first (module docstring); `complete`: only among rows that give every key field."""
  want = key.row()
  best, best_fields = None, -1
  for row in rows:
    given = [f for f in KEY_FIELDS if f in row]
    if complete and len(given) < len(KEY_FIELDS):
      continue
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
  """The cache's rows; an unreadable cache is said and treated as empty (it is only ours:
  the next measurement replaces it)."""
  if not path.exists():
    return []
  try:
    return parse_rows(json.loads(path.read_text(encoding="utf-8")), path)
  except (OSError, ValueError) as e:
    logging.warning("ignoring the GEMM measurement cache %s: %s", path, e)
    return []


def store(key: Key, times: Times) -> None:
  """Adds (or replaces) the measurement of `key` in the cache, under an exclusive lock of the
  file beside it (threads of this process: _LOCK; other processes: flock), re-read under the
  lock so that their rows are kept, written atomically. OSError when it cannot be written."""
  path = cache_file()
  path.parent.mkdir(parents=True, exist_ok=True)
  with _LOCK, open(path.with_name(path.name + ".lock"), "a", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file is closed
    rows = [r for r in _cache_rows(path) if any(r.get(f) != v for f, v in key.row().items())]
    rows.append({**key.row(), **times.row()})
    destinations.write_atomic(str(path), json.dumps({"format": TABLE_FORMAT, "rows": rows},
                                                    indent=1))


def _times(row: dict, source: str) -> Times:
  where = f"{source} ({row['source']})" if row.get("source") else source
  algorithm = (tuple(row[f] for f in ALGORITHM_FIELDS) if ALGORITHM_FIELDS[0] in row
               else None)
  return Times(*(float(row[f]) for f in TIME_FIELDS), where,
               *(float(row.get(f, 0.0)) for f in SPREAD_FIELDS), algorithm)


def find_times(table: str, key: Key) -> Times | None:
  """The times of `key` from the table file `table` (if any), else from the cache (its rows
  with every key field)."""
  if table:
    row = lookup(load_table(table), key)
    if row is not None:
      return _times(row, f"table {table}")
  row = lookup(_cache_rows(cache_file()), key, complete=True)
  return None if row is None else _times(row, f"cache {cache_file()}")


# ---------------------------------------------------------------------------------------------
# The device, and measuring on it.


def device_fields(dev) -> dict[str, str]:
  """The device's key fields: its kind, compute capability and driver ('none' off a GPU)."""
  cc = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
  return {"device_kind": str(dev.device_kind), "compute_capability": str(cc or "none"),
          "driver": driver_version(dev)}


@functools.cache
def _loaded_driver() -> str:
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
    version = ctypes.c_int(0)
    if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0:   # not CUDA_SUCCESS
      return "none"
  except (OSError, AttributeError):   # no driver here (a CPU host, a deviceless compile)
    return "none"
  return f"{version.value // 1000}.{version.value % 1000 // 10}"


def driver_version(dev) -> str:
  """The CUDA version of the driver that runs `dev`, as it reports it (cuDriverGetVersion of
  libcuda.so.1, e.g. '12.8'; 'none' off a GPU and where the driver does not load)."""
  return _loaded_driver() if dev.platform == "gpu" else "none"


# The files whose change can change a GEMM's time or result: the library's FFI handlers, how
# they are built and called, s24jax's compression of the operands (s24jax.kernels.cusparselt;
# a file that does not exist is left out), and the backend's GEMMs with their dense twins
# (s24jax.sparse_ops).
_KERNELS = pathlib.Path(timing.__file__).parent / "cusparselt"
_SPARSE_OPS = pathlib.Path(__file__).parent
GEMM_CODE_FILES = (
    *(_KERNELS / f for f in ("cusparselt_ffi.cc", "scratch.h", "ffi_support.h", "library.py",
                             "ops.py", "layout.py", "compression.py", "algorithms.py")),
    *(_SPARSE_OPS / f for f in ("cusparselt.py", "cusparselt_gemms.py", "common.py", "fp8.py")))


def code_hash(paths) -> str:
  """12 hex digits of the SHA-256 of the names and contents of those of `paths` that exist."""
  digest = hashlib.sha256()
  for path in map(pathlib.Path, paths):
    if path.is_file():
      digest.update(f"{path.parent.name}/{path.name}\0".encode())
      digest.update(hashlib.sha256(path.read_bytes()).digest())
  return digest.hexdigest()[:12]


@functools.cache
def gemm_code_version() -> str:
  """The version of s24jax's GEMM code: `code_hash` of GEMM_CODE_FILES, once per process."""
  return code_hash(GEMM_CODE_FILES)


def versions() -> dict[str, str]:
  """The software key fields but the library's: JAX's versions, s24jax's GEMM code."""
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "gemm_code": gemm_code_version()}


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


def per_call_stats(fn: Callable[..., jax.Array], *args, calls: int = CALLS,
                   reps: int = REPS) -> tuple[float, float]:
  """(median, spread) in milliseconds per call of fn(*args), timed as `calls` calls inside
  one jitted loop, `reps` loops after one to compile: the median of the loops and their max
  - min. kernels.timing.loop_seconds_each, whose calls take arguments that vary from call to
  call, so that XLA cannot hoist the call out of the loop (an optimization barrier alone does
  not stop it: XLA drops barriers before it hoists loop-invariant work, seen in the CPU HLO)."""
  each = timing.loop_seconds_each(fn, *args, calls=calls, repeats=reps)
  return 1e3 * statistics.median(each), 1e3 * (max(each) - min(each))


def per_call_ms(fn: Callable[..., jax.Array], *args, calls: int = CALLS,
                reps: int = REPS) -> float:
  """The median of `per_call_stats`."""
  return per_call_stats(fn, *args, calls=calls, reps=reps)[0]
