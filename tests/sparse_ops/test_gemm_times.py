"""Tests of s24jax/sparse_ops/gemm_times.py: the table format (both versions, its errors), the
cache (what it keeps and uses, two processes writing it at once), the key's driver and GEMM
code fields, and the per-call statistics of a timed loop. On CPU: no GPU is timed here."""
import dataclasses
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import pytest

from s24jax.nn import sparse_linear
from s24jax.kernels import timing
from s24jax.methods import registry
from s24jax.sparse_ops import cusparselt as cslt_backend
from s24jax.sparse_ops import gemm_choice
from s24jax.sparse_ops import gemm_times
from s24jax.sparse_ops.options import GemmOptions

REPO = pathlib.Path(__file__).resolve().parents[2]
OPTS = GemmOptions(mvue=True, transposable=True, backend="cusparselt", gemm_choice="measured")


@pytest.fixture(autouse=True)
def _fresh_policy(tmp_path, monkeypatch):
  """Each test as a new process on a machine with an empty measurement cache."""
  monkeypatch.setenv("S24JAX_CACHE", str(tmp_path / "cache"))
  gemm_choice.forget()
  yield
  gemm_choice.forget()


# Every key field, written by hand.
KEY = {"device_kind": "a GPU", "compute_capability": "9.0", "driver": "12.8",
       "library": "cusparselt", "library_version": "0.10.0", "jax": "0.10.2", "jaxlib": "0.10.2",
       "gemm_code": "0123456789ab", "gemm": "forward", "m": 64, "n": 96, "k": 32,
       "layout": "TN", "d_order": "col", "a_type": "bf16", "b_type": "bf16", "d_type": "bf16"}


def _key(**fields) -> gemm_times.Key:
  return gemm_times.Key(**{**KEY, **fields})


def _row(**fields):
  """A hand-written table row: the GEMM's kind and shape, its three times."""
  return {"gemm": "forward", "m": 64, "n": 96, "k": 32, "sparse_ms": 1.0, "compress_ms": 0.5,
          "dense_ms": 2.0, **fields}


def _write(path, rows, fmt=gemm_times.TABLE_FORMAT):
  # json.dumps writes float('nan') and float('inf') as NaN and Infinity, as a hand might.
  path.write_text(json.dumps({"format": fmt, "rows": rows}))
  return str(path)


# ---------------------------------------------------------------------------------------------
# The table format.


def test_a_bad_table_is_one_line_naming_the_file_the_row_and_the_field(tmp_path):
  """Each file is refused when the run's config is built, in one line naming it, the row and
  the field: NaN and infinite times and spreads among them (they would make every
  comparison false, so a GEMM could never be chosen, silently)."""
  ste = registry.get_method("ste")
  cases = {
      "missing.json": (None, "cannot be read"),
      "notjson.json": ("{rows: ", "not readable as JSON"),
      "noformat.json": (json.dumps({"rows": [_row()]}), "format"),
      "typo.json": ([_row(M=3)], "row 0: unknown field.*M"),
      "noms.json": ([{k: v for k, v in _row().items() if k != "dense_ms"}],
                    "row 0: missing dense_ms"),
      "strshape.json": ([_row(m="64")], "row 0: m must be an integer"),
      "nan.json": ([_row(), _row(dense_ms=math.nan)], "row 1: dense_ms must be a finite"),
      "inf.json": ([_row(sparse_ms=math.inf)], "row 0: sparse_ms must be a finite"),
      "infspread.json": ([_row(compress_spread_ms=-math.inf)],
                         "row 0: compress_spread_ms must be a finite"),
      "negative.json": ([_row(dense_spread_ms=-0.1)], "row 0: dense_spread_ms must be"),
      "partalg.json": ([_row(alg_id=1, split_k=1)], "row 0: alg_id, split_k, split_k_mode"),
      "floatalg.json": ([_row(alg_id=1.5, split_k=1, split_k_mode=0, split_k_buffers=1)],
                        "row 0: alg_id.*alg_id=1.5"),
      # The fields that format 1 did not have need format 2 (an old reader would refuse them).
      "old.json": ([_row(driver="12.8")], "row 0: unknown field.*driver.*gemm_times/2"),
  }
  for name, (content, want) in cases.items():
    path = tmp_path / name
    if isinstance(content, list):
      _write(path, content, gemm_times.FORMATS[0] if name == "old.json" else
             gemm_times.TABLE_FORMAT)
    elif content is not None:
      path.write_text(content)
    with pytest.raises(ValueError, match=want) as e:
      sparse_linear.SparsityConfig(method=ste, backend="cusparselt", gemm_table=str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value), (name, e.value)


def test_format_1_files_are_still_read(tmp_path):
  """The example tables of experiments/ (format 1) and a hand-written format-1 row: read,
  with no spreads (0) and no algorithm."""
  for example in sorted((REPO / "experiments" / "gemm_tables").glob("*.json")):
    data = json.loads(example.read_text())
    assert data["format"] == "s24jax.gemm_times/1"
    assert len(gemm_times.load_table(str(example))) == len(data["rows"]) > 0
  table = _write(tmp_path / "old.json", [_row()], "s24jax.gemm_times/1")
  times = gemm_times.find_times(table, _key())
  assert (times.sparse_ms, times.compress_ms, times.dense_ms) == (1.0, 0.5, 2.0)
  assert (times.sparse_spread_ms, times.compress_spread_ms, times.dense_spread_ms,
          times.algorithm) == (0.0, 0.0, 0.0, None)


def test_spreads_and_the_algorithm_are_cached_and_read_back():
  """store writes every key field, the times, their spreads and the algorithm (read here as
  plain JSON), and find_times gives them back."""
  key = _key()
  times = gemm_times.Times(0.5, 0.25, 1.0, "measured here", sparse_spread_ms=0.01,
                           compress_spread_ms=0.02, dense_spread_ms=0.03, algorithm=(3, 2, 1, 4))
  gemm_times.store(key, times)
  data = json.loads(gemm_times.cache_file().read_text())
  assert data["format"] == gemm_times.TABLE_FORMAT == "s24jax.gemm_times/2"
  (row,) = data["rows"]
  assert {f: row[f] for f in KEY} == KEY and set(gemm_times.KEY_FIELDS) == set(KEY)
  assert {f: row[f] for f in ("sparse_ms", "compress_ms", "dense_ms", "sparse_spread_ms",
                              "compress_spread_ms", "dense_spread_ms", "alg_id", "split_k",
                              "split_k_mode", "split_k_buffers")} == {
      "sparse_ms": 0.5, "compress_ms": 0.25, "dense_ms": 1.0, "sparse_spread_ms": 0.01,
      "compress_spread_ms": 0.02, "dense_spread_ms": 0.03, "alg_id": 3, "split_k": 2,
      "split_k_mode": 1, "split_k_buffers": 4}
  got = gemm_times.find_times("", key)
  assert got.source.startswith("cache") and got == dataclasses.replace(times, source=got.source)


def test_the_cache_uses_only_rows_with_every_key_field(tmp_path):
  """A cache row without the GEMM code or driver (written by an older s24jax, format 1) is
  not used: that measurement may be of other code. A table row may leave them out."""
  key = _key()
  old = {k: v for k, v in KEY.items() if k not in ("driver", "gemm_code")}
  path = gemm_times.cache_file()
  path.parent.mkdir(parents=True)
  _write(path, [{**old, "sparse_ms": 0.1, "compress_ms": 0.0, "dense_ms": 1.0}],
         "s24jax.gemm_times/1")
  assert gemm_times.find_times("", key) is None
  table = _write(tmp_path / "t.json", [{**old, "sparse_ms": 0.1, "compress_ms": 0.0,
                                        "dense_ms": 1.0}], "s24jax.gemm_times/1")
  assert gemm_times.find_times(table, key).sparse_ms == 0.1
  # Another GEMM code or driver in a complete cache row: not this key's either.
  gemm_times.store(_key(gemm_code="ba9876543210"), gemm_times.Times(0.2, 0.0, 1.0, "other"))
  gemm_times.store(_key(driver="13.0"), gemm_times.Times(0.3, 0.0, 1.0, "other"))
  assert gemm_times.find_times("", key) is None
  gemm_times.store(key, gemm_times.Times(0.4, 0.0, 1.0, "this"))
  assert gemm_times.find_times("", key).sparse_ms == 0.4


# ---------------------------------------------------------------------------------------------
# The key's driver and GEMM code.


def test_the_gemm_code_version_hashes_the_files_that_exist(tmp_path):
  """On copies of the GEMM files: 12 hex digits; the same for the same contents; another
  for one changed byte or a file that appears; a file missing is left out."""
  present = [p for p in gemm_times.GEMM_CODE_FILES if p.is_file()]
  assert {p.name for p in present} >= {"cusparselt_ffi.cc", "scratch.h", "ops.py",
                                       "cusparselt.py", "common.py"}
  copies = []
  for i, p in enumerate(gemm_times.GEMM_CODE_FILES):
    copies.append(tmp_path / str(i) / p.name)
    copies[-1].parent.mkdir()
    if p.is_file():
      shutil.copy(p, copies[-1])
  version = gemm_times.gemm_code_version()
  assert len(version) == 12 and all(c in "0123456789abcdef" for c in version), version
  assert gemm_times.code_hash(copies) == gemm_times.code_hash(copies)
  changed = [c for c in copies if c.is_file()][0]
  before = gemm_times.code_hash(copies)
  changed.write_bytes(changed.read_bytes() + b" ")
  after = gemm_times.code_hash(copies)
  assert after != before
  extra = [c for c in copies if not c.is_file()] or [tmp_path / "new.py"]
  extra[0].write_text("# a file that appears")
  assert gemm_times.code_hash(copies + [tmp_path / "new.py"]) != after
  key = cslt_backend.gemm_key("forward", 64, 32, 16, jnp.bfloat16, OPTS)
  assert key.gemm_code == version and key.driver == "none"   # a CPU has no driver


def test_the_driver_version_is_the_loaded_drivers(monkeypatch):
  """cuDriverGetVersion of libcuda.so.1 (faked here: 12080 is CUDA 12.8) for a GPU; 'none'
  off a GPU, where the library does not load, and where the call fails."""
  gpu = types.SimpleNamespace(platform="gpu")

  class Cuda:
    def __init__(self, result, version):
      self.result, self.version = result, version

    def cuDriverGetVersion(self, out):   # pylint: disable=invalid-name (the C name)
      out._obj.value = self.version       # ctypes.byref(c_int): the c_int is ._obj
      return self.result

  def loads(lib):
    def cdll(name):
      assert name == "libcuda.so.1"
      if lib is None:
        raise OSError("libcuda.so.1: cannot open shared object file")
      return lib
    return cdll

  for lib, want in ((Cuda(0, 12080), "12.8"), (Cuda(0, 13000), "13.0"), (None, "none"),
                    (Cuda(3, 12080), "none")):
    monkeypatch.setattr(gemm_times.ctypes, "CDLL", loads(lib))
    gemm_times._loaded_driver.cache_clear()   # pylint: disable=protected-access
    assert gemm_times.driver_version(gpu) == want
  assert gemm_times.driver_version(jax.devices("cpu")[0]) == "none"
  gemm_times._loaded_driver.cache_clear()     # pylint: disable=protected-access


# ---------------------------------------------------------------------------------------------
# The per-call statistics.


def test_per_call_stats_are_the_median_and_the_spread_of_the_loops(monkeypatch):
  """With a fake clock (each loop of 4 calls takes 4, 12, 8, 20, 16 ms): every loop's time
  per call, in order; their median (loop_seconds, unchanged) and max - min."""
  ticks = iter([0.0, 0.004, 1.0, 1.012, 2.0, 2.008, 3.0, 3.020, 4.0, 4.016])
  monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
  each = timing.loop_seconds_each(lambda x: x * 2.0, jnp.ones(3), calls=4, repeats=5)
  assert each == pytest.approx([0.001, 0.003, 0.002, 0.005, 0.004])
  monkeypatch.setattr(timing, "loop_seconds_each", lambda fn, *a, calls, repeats: each)
  assert timing.loop_seconds(None, calls=4, repeats=5) == pytest.approx(0.003)
  median, spread = gemm_times.per_call_stats(None, calls=4, reps=5)
  assert (median, spread) == (pytest.approx(3.0), pytest.approx(4.0))
  assert gemm_times.per_call_ms(None, calls=4, reps=5) == pytest.approx(3.0)


# ---------------------------------------------------------------------------------------------
# Two processes writing the cache at once.

_STORE_MANY = """
import json, os, pathlib, sys, time
from s24jax.sparse_ops import gemm_times
fields, name, n, ready, go = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), *sys.argv[4:]
pathlib.Path(ready).touch()
while not os.path.exists(go):
  time.sleep(0.001)
for i in range(n):
  gemm_times.store(gemm_times.Key(**{**fields, "device_kind": name, "m": i}),
                   gemm_times.Times(1.0, 0.5, 2.0, name))
"""


@pytest.mark.slow
def test_two_processes_storing_at_once_keep_every_row(tmp_path):
  """Two processes started together each store N keys of their own into one cache: the
  file holds all 2 N rows (without the lock, one's read-modify-write loses the other's)."""
  n = 40
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "S24JAX_CACHE": str(tmp_path / "cache")}
  go = tmp_path / "go"
  procs = [subprocess.Popen([sys.executable, "-c", _STORE_MANY, json.dumps(KEY), name, str(n),
                             str(tmp_path / f"ready-{name}"), str(go)], env=env, cwd=REPO)
           for name in ("A", "B")]
  deadline = time.time() + 120
  while not all((tmp_path / f"ready-{name}").exists() for name in "AB"):
    assert time.time() < deadline and all(p.poll() is None for p in procs), "a worker died"
    time.sleep(0.01)
  go.touch()
  assert [p.wait(timeout=120) for p in procs] == [0, 0]
  data = json.loads((tmp_path / "cache" / "gemm_choice" / "times.json").read_text())
  got = sorted((r["device_kind"], r["m"]) for r in data["rows"])
  assert got == sorted((name, i) for name in "AB" for i in range(n))
  assert [p.name for p in (tmp_path / "cache" / "gemm_choice").iterdir()
          if p.name != "times.json.lock"] == ["times.json"]   # no temporary file left
