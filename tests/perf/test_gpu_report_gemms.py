"""Tests of the GPU report's cuSPARSELt sections on a CPU (the stand-in, tiny shapes): the GEMM
rows (one compiled program per row, every field, each variant computing the row's product
against NumPy, the GEMM as the op builds it), the bandwidth and the against-dense arithmetic
against hand computations, the plan, the layout check's dump when the bytes differ, and which
libcusparseLt a process names."""
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.perf.gpu_report import bandwidth
from s24jax.perf.gpu_report import gemm_plan
from s24jax.perf.gpu_report import gemm_program
from s24jax.perf.gpu_report import gemms
from s24jax.perf.gpu_report import layouts
from s24jax.perf.gpu_report import libraries
from s24jax.perf.gpu_report import rows
from s24jax.kernels.cusparselt import layout
from s24jax.kernels.cusparselt import library
from s24jax.kernels.cusparselt import ops
from s24jax.sparse_ops import cusparselt as cusparselt_backend
from s24jax.sparse_ops import cusparselt_gemms as cslt

# One row that s24jax compresses (bf16 forward, on the sm90 16-bit tiles) and one only the
# library does (FP8 forward: k = 64 is off the 8-bit layout's 128-column stripes).
BF16_ROW = gemm_plan.Row("forward", 64, 256, 256, "fc", "bf16")
FP8_ROW = gemm_plan.Row("forward", 64, 256, 256, "fc", "fp8")


@pytest.fixture(scope="module")
def gemm_rows(tmp_path_factory):
  """The section run on BF16_ROW and FP8_ROW, with the compilations of the row program
  counted by jax's own compile events: (record, {row name: compilations})."""
  path = str(tmp_path_factory.mktemp("gemms") / "r.jsonl")
  compiles, current = {}, [None]

  def listen(event, duration, **kwargs):
    del duration
    if event == "/jax/core/compile/backend_compile_duration" and \
        gemm_program.PROGRAM_NAME in str(kwargs.get("fun_name", "")):
      compiles[current[0]] = compiles.get(current[0], 0) + 1

  def measure(row, **kwargs):
    current[0] = row.name
    return real_measure(row, **kwargs)

  real_measure = gemms.measure
  jax.monitoring.register_event_duration_secs_listener(listen)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(gemm_plan, "plan", lambda smoke: [BF16_ROW, FP8_ROW])
    m.setattr(gemms, "measure", measure)
    try:
      with jax.default_device(jax.devices("cpu")[0]):
        gemms.run(rows.Section(path, "gemms"), deadline=time.time() + 600, smoke=True)
    finally:
      jax.monitoring.unregister_event_duration_listener(listen)
  return rows.read(path), compiles


def test_each_row_compiles_one_program_for_all_its_variants(gemm_rows):
  record, compiles = gemm_rows
  timed = {r["row"]: r for r in record if r.get("status") == "ok"}
  assert set(timed) == {BF16_ROW.name, FP8_ROW.name}, record
  assert compiles == {BF16_ROW.name: 1, FP8_ROW.name: 1}, compiles
  # ... and that program timed every variant that applies (7 and 5 here).
  assert len(timed[BF16_ROW.name]["calls"]) == 7 and len(timed[FP8_ROW.name]["calls"]) == 5


def test_every_field_of_a_gemm_row(gemm_rows):
  record, _ = gemm_rows
  by_name = {r["row"]: r for r in record}
  assert by_name["torch peer"]["status"] == "skipped"          # no CUDA torch here
  bf16, fp8 = by_name[BF16_ROW.name], by_name[FP8_ROW.name]
  for r, serves in ((bf16, True), (fp8, False)):
    assert r["kind"] == "forward" and r["shape_NK"] == [256, 64] and r["tokens"] == 256
    assert r["gemm"] == dict(m=256, n=256, k=64, layout="TN", d_order="col"), r["gemm"]
    assert r["op_compression"] == ("s24jax" if serves else "library")
    assert (r["s24jax_layout"] == "sm90_16bit") if serves else r["s24jax_layout"] is None
    assert r["algorithm"] == dict(alg_id=0, split_k=1, split_k_mode=0, split_k_buffers=1,
                                  max_id=1)                    # the stand-in's search
    assert r["alg_check"] is None and r["alg_check_skipped"] is None   # checked: agrees
    assert r["errors"] == {}, r["errors"]
    applies = set(gemms.VARIANTS) - (set() if serves else
                                      {"compress_s24jax", "compress_s24jax+sparse"})
    for name in gemms.VARIANTS:
      ms, spread = r["ms"][name], r["spread_ms"][name]
      if name in applies:
        assert isinstance(ms, float) and ms > 0 and spread == 0.0, (name, ms)  # 1 repeat
        assert r["calls"][name] == gemm_plan.MIN_CALLS
      else:
        assert ms is None and spread is None and name not in r["calls"]
    assert r["ms"]["torch_sparse"] is None and r["ms"]["torch_sparse+compress"] is None
    b = r["compression_bandwidth"]
    # op(A) (256, 64): 16384 values; half of them kept, and 2 bits of metadata per kept one.
    assert (b["bytes_read"], b["bytes_written"]) == (
        (32768, 16384 + 2048) if serves else (16384, 8192 + 2048))
    assert (b["gb_per_s"] > 0) if serves else b["gb_per_s"] is None
    assert b["peak_gb_per_s"] is None and b["ratio_to_ideal"] is None     # a CPU: no peak
    v = r["vs_dense"]
    assert v["kernel_speedup"] == pytest.approx(
        r["ms"]["dense_xla"] / min(r["ms"]["sparse"], r["ms"]["sparse_searched"]))
    assert isinstance(v["kernel_faster"], bool)
    assert isinstance(r["estimated_seconds"], float) and r["seconds"] >= 0
    libs = r["libraries"]
    assert libs["cusparselt_serving"] == library.serving(), libs
    assert libs["cusparselt_serving"]["path"] in libs["cusparselt_mapped"]
    assert isinstance(libs["pid"], int)


@pytest.mark.parametrize("row", [gemm_plan.Row(k, 64, 256, 256, "fc", p)
                                 for k in gemm_plan.KINDS for p in ("bf16", "fp8")],
                         ids=lambda r: r.name)
def test_every_variant_computes_the_rows_product(row):
  """Each GEMM variant gives D = op(A) op(B) of the row's operands (a NumPy product of the
  values as the GEMM takes them: under FP8, A and B as the op quantizes them), and s24jax's
  compression writes the library's bytes (the stand-in writes s24jax's layouts)."""
  with ops.standin(), jax.default_device(jax.devices("cpu")[0]):
    s = gemms.setup(row, smoke=True)
    operands, a_scale = gemms.operands(s)
    variants = {v.name: v for v in gemms.variants(s, a_scale, None, smoke=True)}
    g = s.gemm
    a = np.asarray(operands["a"].astype(jnp.float32), np.float64)
    if s.fmt is not None:
      a = a / float(a_scale)                                    # back to the operand's values
    op_a = a if g.trans_a else a.T                              # (m, k)
    b = operands["b"]
    if s.fmt is not None:                                       # B's values as FP8 GEMMs take them
      qb, b_scale = cslt.quantize(b, s.fmt, s.opts)
      b = np.asarray(qb.astype(jnp.float32), np.float64) / float(b_scale)
    b = np.asarray(b, np.float64)
    op_b = b if g.trans_b else b.T                              # (k, n)
    want = op_a @ op_b
    abs_sum = np.abs(op_a) @ np.abs(op_b)                        # sum of |a| |b| per output
    if not g.d_row_major:
      want, abs_sum = want.T, abs_sum.T                          # as the D array
    for name, v in variants.items():
      if name.startswith("compress_") and "+" not in name:
        continue                                                  # a buffer, compared below
      out = v.fn(*(operands[x] for x in v.args))
      # Elementwise, from the arithmetic: D rounded to the GEMM's output type and the FP8
      # scales applied in float32 (one ulp of the coarser type), float32 sums in any order
      # (2^-20 of sum |a| |b| covers k <= 256 additions).
      unit = max(jnp.finfo(out.dtype).eps, jnp.finfo(s.d_dtype).eps)
      bound = unit * np.abs(want) + 2.0 ** -20 * abs_sum + 1e-30
      out = np.asarray(out.astype(jnp.float32), np.float64)
      assert out.shape == want.shape, (name, out.shape, want.shape)
      excess = np.abs(out - want) - bound
      assert (excess <= 0).all(), (name, excess.max())
    if "compress_s24jax" in variants:
      ours = variants["compress_s24jax"].fn(operands["source"])
      theirs = variants["compress_library"].fn(operands["a"])
      np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e5m2], ids=["bf16", "e5m2"])
@pytest.mark.parametrize("kind", gemm_plan.KINDS)
@pytest.mark.parametrize("n,k", [(256, 64), (64, 256), (192, 96)])
def test_the_rows_gemm_is_the_ops(kind, n, k, dtype):
  with ops.standin():
    want = cusparselt_backend._gemm(kind, 512, n, k, dtype)   # pylint: disable=protected-access
  got = gemms.op_gemm(kind, 512, n, k, dtype, ops.STANDIN_COMPUTE_CAPABILITY)
  assert got == want
  row = gemm_plan.Row(kind, k, n, 512, "fc", "bf16")           # W~ (n, k): 'fc' is (hidden, width)
  assert gemm_plan.gemm_dims(row) == (got.m, got.n, got.k)   # what the estimate assumes


def test_bandwidth_against_a_hand_computation():
  # op(A) (3072, 768) bf16: reads 3072 * 768 * 2 = 4,718,592 bytes and writes half the values
  # (2,359,296) and 2 bits per kept value (294,912): 7,372,800 bytes in all.
  b = bandwidth.compression(0.003, 3072, 768, 2, "NVIDIA H100 80GB HBM3")
  assert (b["bytes_read"], b["bytes_written"]) == (4_718_592, 2_654_208)
  assert b["gb_per_s"] == pytest.approx(7_372_800 / 3e-6 / 1e9)             # 2457.6
  assert b["peak_gb_per_s"] == 3350.0
  assert b["ideal_ms"] == pytest.approx(7_372_800 / 3.35e12 * 1e3)          # 0.0022008 ms
  assert b["ratio_to_ideal"] == pytest.approx(0.003 / 0.0022008358, rel=1e-6)   # 1.363
  assert b["within_criterion"] is False
  # FP8 (1-byte values) on an H200 at 1.2x its ideal: (1,048,576 + 655,360) bytes at 4.8 TB/s.
  ideal_ms = (1_048_576 + 655_360) / 4.8e12 * 1e3
  b = bandwidth.compression(1.2 * ideal_ms, 1024, 1024, 1, "NVIDIA H200")
  assert b["bytes_written"] == 524_288 + 131_072
  assert b["ratio_to_ideal"] == pytest.approx(1.2) and b["within_criterion"] is True
  assert bandwidth.peak("NVIDIA A100-SXM4-80GB")[0] == 2.0e12
  for unknown in ("NVIDIA L4", "NVIDIA A100-SXM4-40GB", "NVIDIA H100 PCIe", "cpu"):
    b = bandwidth.compression(0.01, 64, 64, 2, unknown)
    assert b["gb_per_s"] > 0 and b["peak_gb_per_s"] is None and b["ratio_to_ideal"] is None
  assert bandwidth.compression(None, 64, 64, 2, "NVIDIA H200")["gb_per_s"] is None


def test_versus_dense_against_hand_computations():
  ms = {"dense_xla": 1.0, "sparse": 0.8, "sparse_searched": 0.85,
        "compress_s24jax+sparse": 0.95, "compress_library+sparse": None}
  v = gemms.versus_dense(ms)
  assert v["kernel_speedup"] == pytest.approx(1.25) and v["kernel_faster"] is True
  assert v["with_compression_speedup"]["s24jax"] == pytest.approx(1 / 0.95)
  assert v["with_compression_faster"] == {"s24jax": False, "library": None}
  assert gemms.versus_dense(dict(ms, sparse=0.95))["kernel_speedup"] == pytest.approx(
      1 / 0.85)                                                  # the faster algorithm's
  v = gemms.versus_dense({"dense_xla": 1.0, "sparse": 0.95, "sparse_searched": None})
  assert v == {"kernel_speedup": pytest.approx(1 / 0.95), "kernel_faster": False}
  assert gemms.versus_dense({"dense_xla": 1.1, "sparse": 1.0})["kernel_faster"] is True  # 1.10
  assert gemms.versus_dense({"dense_xla": None, "sparse": 1.0})["kernel_speedup"] is None


def test_the_plan_covers_every_gemm_once_most_informative_first():
  plan = gemm_plan.plan(smoke=False)
  shapes = [(d, 4 * d) for d in gemm_plan.WIDTHS] + [(4096, 11008)]
  want = {(kind, d, h, t, m, p) for kind in ("forward", "dgrad", "wgrad") for d, h in shapes
          for t in (8192, 65536) for m in ("fc", "proj") for p in ("bf16", "fp8")}
  got = [(r.kind, r.width, r.hidden, r.tokens, r.matrix, r.precision) for r in plan]
  assert len(got) == len(set(got)) == len(want) == 168 and set(got) == want
  assert got[0] == ("forward", 768, 3072, 65536, "fc", "bf16")
  assert got[6:12] == [(k, 4096, 11008, 65536, m, "bf16") for m in ("fc", "proj")
                       for k in ("forward", "dgrad", "wgrad")]
  assert plan[6].shape_nk == (11008, 4096) and plan[9].shape_nk == (4096, 11008)


def test_a_row_that_cannot_fit_is_skipped_with_its_estimate(tmp_path, monkeypatch):
  path = str(tmp_path / "r.jsonl")
  monkeypatch.setattr(gemm_plan, "plan", lambda smoke: [BF16_ROW])
  monkeypatch.setattr(gemms, "measure", lambda *a, **k: pytest.fail("a row ran"))
  monkeypatch.setattr(gemms.torch_peer, "unavailable", lambda: "no torch (test)")
  gemms.run(rows.Section(path, "gemms"), deadline=time.time() + 5, smoke=True)
  [peer, row] = rows.read(path)
  assert peer["row"] == "torch peer" and row["status"] == "skipped", row
  assert row["reason"].startswith("budget:") and f"{gemm_plan.SMOKE_ROW_SECONDS:.0f} s" in \
      row["reason"] and row["kind"] == "forward", row


@pytest.mark.parametrize("natural", [False, True], ids=["same_bytes", "bytes_differ"])
def test_the_layout_check_keeps_the_probe_where_the_bytes_differ(natural, tmp_path,
                                                                  monkeypatch):
  """Under the stand-in the library writes s24jax's layouts, so every case agrees; with the
  stand-in's own natural order in their place (a library that disagrees), every case with a
  layout differs and leaves its probe and the library's bytes of it, which are that natural
  order's (computed here from the probe)."""
  if natural:
    monkeypatch.setattr(ops, "standin_layout", lambda gemm, a_dtype: layout.NATURAL)
  files = tmp_path / "report"
  path = str(tmp_path / "report.jsonl")
  with jax.default_device(jax.devices("cpu")[0]):
    layouts.run(rows.Section(path, "layouts"), time.time() + 300, True, str(files))
  record = rows.read(path)
  assert len(record) == len(layouts.cases(True)) == 7, record
  with_layout = [r for r in record if r["layout"] is not None]
  assert len(with_layout) == 6 and all(r["status"] == "ok" for r in record), record
  by_name = {lay.name: lay for lay in layout.LAYOUTS}
  for r in record:
    assert r["used_by"] and all(isinstance(u, str) for u in r["used_by"]), r
    assert r["libraries"]["cusparselt_serving"] == library.serving(), r
    assert r["verified_layout"] == (by_name[r["layout"]].verified if r["layout"] else None)
  for r in with_layout:
    if not natural:
      assert r["mismatch"] is None and r["files"] == [], r
      continue
    assert "bytes differ" in r["mismatch"], r
    probe_file, library_file = (tmp_path / p for p in r["files"])
    probe, theirs = np.load(probe_file), np.load(library_file)
    dtype = layouts.DTYPES[r["dtype"]]
    assert probe.shape == (r["m"], r["k"]) and probe.dtype == np.float32
    np.testing.assert_array_equal(probe.astype(dtype).astype(np.float32), probe)  # exact
    assert ((probe != 0).reshape(r["m"], -1, 4).sum(-1) == 2).all()
    want = np.asarray(layout.compress(jnp.asarray(probe, dtype), layout.NATURAL))
    np.testing.assert_array_equal(theirs, want)
  if not natural:
    assert not (files / layouts.FOLDER).exists()


def test_a_snapshot_names_the_first_loaded_library_and_loads_nothing_unasked(monkeypatch):
  snap = libraries.snapshot(register=True)
  serving = library.serving()
  assert snap["cusparselt_serving"] == serving and serving["version"].count(".") == 2
  assert snap["cusparselt_load_order"][0] == serving["path"], snap  # the first one serves
  assert serving["path"] in snap["cusparselt_mapped"]
  # Without `register`, a process whose handlers are not loaded is left as it is.
  class NotLoaded:
    @staticmethod
    def cache_info():
      return type("Info", (), {"currsize": 0})()
  monkeypatch.setattr(library, "register", NotLoaded)
  monkeypatch.setattr(library, "serving", lambda: pytest.fail("serving() loads the handlers"))
  snap = libraries.snapshot(register=False)
  assert snap["cusparselt_serving"] is None and "cusparselt_serving_error" not in snap
  assert isinstance(snap["cusparselt_mapped"], list) and math.isfinite(snap["pid"])
