"""Tests of s24jax.kernels.compile_check and s24jax.kernels.aot: deviceless GPU compiles of the
kernels. The PTX / ptxas-log parsers are checked against hand-written PTX and logs whose counts
are known.

The `aot` tests compile for real (XLA's CUDA compiler, ptxas) and are skipped without the
CUDA compile plugin (requirements-gpu-aot.txt). Each runs the command line in a subprocess:
a process compiles for one GPU only (Mosaic GPU registers the first target it sees), and the
deviceless set-up must precede any jax backend. The parser tests run everywhere.
"""
import json
import os
import subprocess
import sys

import pytest

from s24jax.kernels import aot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo


def test_mma_instruction_scan():
  ptx = "\n".join([
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};",
      "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 ...;",
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 ...;",
      "wgmma.mma_async.sp.sync.aligned.m64n64k32.f32.bf16.bf16 ...;",
      "tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd1, %rd2, %r2, p;",
      "tcgen05.mma.sp.cta_group::1.kind::f16 [%r1], %rd1, %rd2, [%r3], %r2, p;",
      "// mma.sync in a comment does not count",
      "ld.global.nc.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];",
  ])
  assert aot.mma_instructions(ptx) == {
      "mma.sync": 1, "mma.sp.sync": 1, "wgmma.mma_async": 1, "wgmma.mma_async.sp": 1,
      "tcgen05.mma": 1, "tcgen05.mma.sp": 1}


def test_ptxas_report_parses_a_dumped_log(tmp_path):
  """Mosaic GPU's own ptxas -v log beside the PTX is read (no ptxas needed)."""
  ptx = tmp_path / "k_0.ptx"
  ptx.write_text(".version 9.0\n.target sm_100a\n.visible .entry k_0(\n"
                 "tcgen05.mma.sp.cta_group::1.kind::f16 [%r1], %rd1, %rd2, [%r3], %r2, p;\n")
  (tmp_path / "k_0.ptxas").write_text(
      "ptxas info    : Compiling entry function 'k_0' for 'sm_100a'\n"
      "ptxas info    : Function properties for k_0\n"
      "    16 bytes stack frame, 24 bytes spill stores, 8 bytes spill loads\n"
      "ptxas info    : Used 78 registers, used 2 barriers, 1024 bytes smem\n")
  (tmp_path / "k_0.sass").write_text("UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR5] ;\nHMMA.16816\n")
  (r,) = aot.ptxas_report(ptx, "b200")
  assert (r.entry, r.arch, r.registers, r.spill_bytes, r.stack_bytes, r.smem_bytes) == (
      "k_0", "sm_100a", 78, 32, 16, 1024)
  assert r.instructions == {"tcgen05.mma.sp": 1}
  assert r.sass_mma == {"UTC*MMA": 1, "HMMA": 1}


def test_missing_plugin_names_the_install_command(monkeypatch):
  monkeypatch.setattr(aot, "ptxas_path", lambda: None)
  with pytest.raises(aot.PluginMissing, match="requirements-gpu-aot.txt"):
    aot.check_plugin()


def _run(tmp_path, *args):
  out = tmp_path / "cc.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "s24jax.kernels.compile_check", *args, "--json",
                      str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=900, check=False)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  records = json.loads(out.read_text())
  assert records
  for rec in records:
    assert rec["ok"] and rec["spill_bytes"] == 0, rec
    assert {"kernel", "shape", "ok", "registers", "spill_bytes", "instructions"} <= set(rec)
  return records


@pytest.mark.slow
@pytest.mark.aot
def test_h100_every_kernel_at_one_shape(tmp_path):
  recs = _run(tmp_path, "--gpu", "h100", "--widths", "768", "--tokens", "64")
  kernels_seen = {r["kernel"] for r in recs}
  assert {"sparsify24", "transposable_mask24_compressed", "mvue24", "venom_compress",
          "venom_matmul", "sparse24_matmul_fwd", "sparse24_matmul_dx",
          "sparse24_matmul_dvalues", "geglu_bwd"} <= kernels_seen
  assert all(r["arch"] == "sm_90a" for r in recs)
  mm = [r for r in recs if r["kernel"] == "sparse24_matmul_fwd"]
  assert mm and all("mma.sync" in r["instructions"] for r in mm)


@pytest.mark.slow
@pytest.mark.aot
def test_a100_formerly_spilling_kernels(tmp_path):
  recs = _run(tmp_path, "--gpu", "a100", "--widths", "1600", "--tokens", "64",
              "--only", "transposable_mask24,transposable_mask24_compressed,venom_compress")
  assert len(recs) == 5 and all(r["arch"] == "sm_80" for r in recs)   # 2 W x 2 + 1


@pytest.mark.slow
@pytest.mark.aot
def test_b200_tcgen05_uses_sparse_tensor_cores(tmp_path):
  recs = _run(tmp_path, "--gpu", "b200", "--widths", "768", "--tokens", "64",
              "--only", "tcgen05_forward,tcgen05_data_grad,tcgen05_weight_grad")
  tc = [r for r in recs if r["kernel"].startswith("tcgen05_")]
  assert len(tc) == 6
  for r in tc:
    assert r["instructions"].get("tcgen05.mma.sp", 0) > 0, r
    assert r.get("sass_mma", {}).get("UTC*MMA", 1) > 0, r
