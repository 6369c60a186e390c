"""The cuSPARSELt handlers' device scratch under XLA's FFI contract, without a GPU.

XLA's scratch allocator takes alignments up to 16 only (kernels/cusparselt/rules.py, X1: the
H100 run of 2026-11-27 failed every cuSPARSELt call on a request for 256), and XLA's CPU FFI
gives no scratch at all (X2), so the contract cannot be met by running a handler here. Instead
the handlers' allocation code (kernels/cusparselt/scratch.h, every scratch buffer of
cusparselt_ffi.cc goes through it) is compiled with g++ into a small program,
tests/kernels/cusparselt_scratch_check.cc, against a fake of XLA's C API that enforces X1 and
records each request and free, through the installed jaxlib's own ffi::ScratchAllocator. This
test checks what it recorded: every request obeys XLA's rule, every buffer is 256-byte aligned
and inside the block XLA gave, every block is freed once, and a failure's error carries XLA's
message with the bytes and alignment asked (X3).
"""
import json
import pathlib
import re
import shutil
import subprocess

import jax
import pytest

from s24jax.kernels.cusparselt import library
from s24jax.kernels.cusparselt import rules

DRIVER = pathlib.Path(__file__).with_name("cusparselt_scratch_check.cc")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
  """The driver's cases by name (a list per name), built with the handlers' compiler against
  scratch.h and this jaxlib's FFI headers."""
  try:
    cxx = library.compiler()
  except library.Unavailable as e:
    pytest.skip(str(e))
  exe = tmp_path_factory.mktemp("scratch") / "cusparselt_scratch_check"
  build = subprocess.run(
      [cxx, "-std=c++17", "-O1", "-w", f"-I{library.SOURCE.parent}",
       f"-I{jax.ffi.include_dir()}", f"-DS24_XLA_MAX_ALIGNMENT={rules.XLA_MAX_SCRATCH_ALIGNMENT}",
       str(DRIVER), "-o", str(exe)], capture_output=True, text=True, check=False)
  assert build.returncode == 0, build.stderr[-4000:]
  run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=False)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  out = {}
  for line in run.stdout.splitlines():
    case = json.loads(line)
    assert "decode_error" not in case, case
    out.setdefault(case["case"], []).append(case)
  return out


def _all(cases):
  return [c for group in cases.values() for c in group]


def test_every_request_obeys_xlas_alignment_rule(cases):
  """X1: each alignment asked of XLA is a power of two and at most 16 (the old handler asked
  for 256, which XLA refused)."""
  asked = [r for c in _all(cases) for r in c["requests"]]
  assert asked, "the handlers asked XLA for nothing"
  limit = rules.XLA_MAX_SCRATCH_ALIGNMENT
  bad = [r for r in asked if r["alignment"] & (r["alignment"] - 1) or r["alignment"] > limit]
  assert not bad, f"requests XLA refuses (X1, at most {rules.XLA_MAX_SCRATCH_ALIGNMENT}): {bad}"


def test_each_buffer_is_aligned_inside_its_block_and_freed_once(cases):
  """Every buffer that should exist does: 256-byte aligned (R10), [pointer, pointer + bytes)
  inside the block XLA gave, one request per buffer; every block freed once, with its size,
  when the call ends; the blocks of one call do not overlap."""
  calls = cases["one buffer"] + cases["the algorithm search"]
  assert len(cases["one buffer"]) == 11 and len(cases["the algorithm search"]) == 1
  for call in calls:
    granted = [r for r in call["requests"] if r["granted"]]
    assert len(granted) == len(call["requests"]), call
    for buf in call["buffers"]:
      if buf["bytes"] == 0:   # no buffer, no request
        assert buf["pointer"] == 0 and buf["request"] is None and not buf["error"], buf
        continue
      assert not buf["error"] and buf["request"] is not None, buf
      block = call["requests"][buf["request"]]
      p, n = buf["pointer"], buf["bytes"]
      assert p % rules.SCRATCH_ALIGNMENT == 0, (buf, block)
      assert block["block"] <= p and p + n <= block["block"] + block["size"], (buf, block)
    assert sorted((f["block"], f["size"]) for f in call["frees"]) == sorted(
        (r["block"], r["size"]) for r in granted), call
    spans = sorted((r["block"], r["block"] + r["size"]) for r in granted)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans
  # The fake placed blocks 0, 16, 128 and 240 bytes past a 256-byte boundary: each was met.
  offsets = {c["requests"][0]["block"] % rules.SCRATCH_ALIGNMENT for c in cases["one buffer"]}
  assert offsets == {0, 16, 128, 240}, offsets
  assert not cases["no bytes"][0]["requests"]


def test_a_failed_allocation_says_what_xla_said(cases):
  """X3: XLA's own message (here its out-of-memory refusal) reaches the handler's error, with
  the buffer, the bytes and the alignment asked; nothing is left allocated."""
  (oom,) = cases["out of memory"]
  (buf,) = oom["buffers"]
  (req,) = oom["requests"]
  assert not req["granted"] and buf["pointer"] == 0 and not oom["frees"]
  err = buf["error"]
  assert f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate {req['size']} bytes" in err
  assert "Failed to allocate scratch memory" in err        # ffi::ScratchAllocator's own words
  assert re.search(rf"buffer 0 \({buf['bytes']} bytes aligned to {rules.SCRATCH_ALIGNMENT}, "
                   rf"asked as {req['size']} bytes at alignment {req['alignment']}\)", err), err
  (huge,) = cases["too large to pad"]
  assert not huge["requests"] and "overflows" in huge["buffers"][0]["error"]


def test_the_build_cache_key_follows_the_source_and_its_header(tmp_path, monkeypatch):
  """The handlers' cached library is rebuilt when cusparselt_ffi.cc or scratch.h changes: both
  are in the key (library.source_digest)."""
  source, header = tmp_path / "cusparselt_ffi.cc", tmp_path / "scratch.h"
  shutil.copy(library.SOURCE, source)
  shutil.copy(library.HEADERS[0], header)
  monkeypatch.setattr(library, "SOURCE", source)
  monkeypatch.setattr(library, "HEADERS", (header,))
  keys = [library.source_digest()]
  header.write_text(header.read_text() + "\n// an edit\n")
  keys.append(library.source_digest())
  source.write_text(source.read_text() + "\n// an edit\n")
  keys.append(library.source_digest())
  assert len(set(keys)) == 3, keys
  assert '#include "scratch.h"' in library.SOURCE.read_text()   # the header the key covers


def test_the_handlers_take_scratch_only_through_the_helper():
  """What the driver checks is what the handlers do: cusparselt_ffi.cc never calls XLA's
  allocator itself, only scratch.h's AlignedScratch through its XlaScratch context."""
  text = library.SOURCE.read_text()
  code = re.sub(r"//[^\n]*", "", text)
  assert "Allocate(" not in code and "ScratchAllocator" not in code
  assert ".Ctx<XlaScratch>()" in code and "AlignedScratch(scratch" in code
