"""s24jax/perf/compression_traffic.py, the compressions' memory-traffic tool: its ideal-bytes
formula against hand counts (no compile), its refusals of bad arguments (its --json: never a
file but its own earlier records), and (`aot`) a tiny-shape run
of every case through XLA's real GPU compiler, in a subprocess (aot.start must precede any jax
backend). Only what cannot be brittle is asserted: every case compiles, in the layout the
backend writes, and is counted; how many kernels XLA makes and their bytes are the tool's
output, not a test's claim."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from s24jax.kernels.cusparselt import layout
from s24jax.perf import compression_traffic

import faults

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo


def test_ideal_bytes_is_every_input_read_and_every_output_written_once():
  n, k, t = 64, 128, 32
  w = jax.ShapeDtypeStruct((n, k), jnp.float32)
  mask = jax.ShapeDtypeStruct((n, k), jnp.bool_)
  dy = jax.ShapeDtypeStruct((t, n), jnp.bfloat16)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  # W f32 in, W~ compressed in bf16 out: values n k/2 x 2 bytes, metadata n k / 8 bytes.
  hard = lambda w: layout.compress(w.astype(jnp.bfloat16), layout.SM90_16BIT)   # noqa: E731
  assert compression_traffic.ideal_bytes(hard, (w,)) == 4 * n * k + (n * k + n * k // 8)
  # Two outputs (W~ and W~^T) from W and a bool mask (1 byte each).
  both = lambda w, m: (hard(jnp.where(m, w, 0)), hard(jnp.where(m, w, 0).T))   # noqa: E731
  assert compression_traffic.ideal_bytes(both, (w, mask)) == 5 * n * k + 2 * (n * k + n * k // 8)
  # 8-bit values: n k/2 bytes; the PRNG key is not counted.
  fp8 = lambda w: layout.compress(w.astype(jnp.float8_e4m3fn), layout.SM90_8BIT)   # noqa: E731
  assert compression_traffic.ideal_bytes(fp8, (w,)) == 4 * n * k + n * k // 2 + n * k // 8
  mvue = lambda d, key: layout.compress(d.T, layout.SM90_16BIT)   # noqa: E731
  assert compression_traffic.ideal_bytes(mvue, (dy, key)) == 2 * t * n + (t * n + t * n // 8)


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "124m,7b"], "--shapes: unknown 7b; valid: 124m, 4096"),
    (["--only", "hard,sort"], "--only: unknown sort; valid: hard, soft_scale"),
    (["--gpu", "b200"], "invalid choice: 'b200'"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    compression_traffic.main(argv)
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_existing_json_file_is_not_overwritten(tmp_path, capsys):
  out = tmp_path / "mine.json"
  out.write_text("keep me")
  with pytest.raises(SystemExit):
    compression_traffic.main(["--json", str(out)])
  assert out.read_text() == "keep me" and "exists" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["own_records", "new_folder"])
def test_json_may_be_its_own_records_or_in_a_folder_to_make(target, tmp_path, capsys,
                                                            monkeypatch):
  """The check lets through the tool's own earlier records and a folder that can be made
  (the run then stops at the plugin, made missing here: one line, exit 2, nothing written)."""
  own = tmp_path / "traffic.json"
  own.write_text(json.dumps([{"case": "hard", "ratio": 1.0, "bytes": 1}]))
  path = own if target == "own_records" else tmp_path / "new" / "traffic.json"
  def start():
    raise compression_traffic.aot.PluginMissing("PLUGIN MISSING")
  monkeypatch.setattr(compression_traffic.aot, "start", start)
  before = faults.snapshot(tmp_path)
  code = compression_traffic.main(["--json", str(path)])
  err = capsys.readouterr().err
  assert code == 2 and err.count("\n") == 1 and "PLUGIN MISSING" in err, err
  assert faults.snapshot(tmp_path) == before


_TINY = """
import json
from s24jax.kernels import aot
aot.start()
from s24jax.perf import compression_traffic
rows = compression_traffic.run([compression_traffic.Shape("tiny", 128, 128, 128)], "h100")
print(json.dumps([{k: r[k] for k in ("case", "layout", "kernels", "bytes", "ideal_bytes")}
                  for r in rows]))
"""


@pytest.mark.aot
def test_every_case_compiles_for_an_h100_and_is_counted():
  out = subprocess.run([sys.executable, "-c", _TINY], capture_output=True, text=True,
                       check=True, timeout=600, cwd=ROOT)
  rows = json.loads(out.stdout.strip().splitlines()[-1])
  assert [r["case"] for r in rows] == list(compression_traffic.CASES)
  assert {r["case"]: r["layout"] for r in rows} == {
      "hard": "sm90_16bit", "soft_scale": "sm90_16bit", "transposable_both": "sm90_16bit",
      "soft_fp8": "sm90_8bit", "mvue_dyT": "sm90_16bit"}
  for r in rows:
    assert r["kernels"] >= 1 and r["bytes"] > 0 and r["ideal_bytes"] > 0, r
