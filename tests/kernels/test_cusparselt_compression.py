"""kernels/cusparselt/compression.py: which compression serves an operand, the first-use check
against the library and its fallback (on the CPU: the stand-in and a faked local GPU); on a GPU,
s24jax's bytes against cusparseLtSpMMACompress for every type and shape class the steps use."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import _common
from s24jax.kernels.cusparselt import compression
from s24jax.kernels.cusparselt import layout
from s24jax.kernels.cusparselt import ops

TN = ops.Gemm(m=256, n=128, k=512, trans_a=True, trans_b=False)


@pytest.fixture(autouse=True)
def _fresh():
  compression.forget()
  yield
  compression.forget()


def test_probe_operand_has_two_nonzeros_per_group_in_every_type():
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2):
    a = np.asarray(compression.probe_operand(64, 128, dtype), np.float32)
    assert ((a != 0).reshape(64, 32, 4).sum(-1) == 2).all(), dtype
    assert (np.abs(a[a != 0]) >= 1).all() and (np.abs(a) < 2.01).all()


def test_under_the_standin_s24jax_compresses_in_the_standins_layout():
  """TN on the layout's tiles: layout.py's bytes, in jnp (no FFI call in the program); NN or
  off the tiles: the library's call (here its stand-in)."""
  a = jnp.asarray(compression.probe_operand(TN.m, TN.k, jnp.bfloat16))
  with ops.standin():
    assert compression.s24jax_layout(TN, jnp.bfloat16) is layout.SM90_16BIT
    nn = ops.Gemm(m=256, n=128, k=512, trans_a=False, trans_b=False)
    assert compression.s24jax_layout(nn, jnp.bfloat16) is None
    off = ops.Gemm(m=96, n=128, k=512, trans_a=True, trans_b=False)
    assert compression.s24jax_layout(off, jnp.bfloat16) is None
    jaxpr = jax.make_jaxpr(lambda x: compression.compress(x, TN, b_dtype=x.dtype,
                                                          d_dtype=x.dtype))(a)
    got = compression.compress(a, TN, b_dtype=a.dtype, d_dtype=a.dtype)
  assert "ffi_call" not in str(jaxpr)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(layout.compress(a, layout.SM90_16BIT)))


def test_a_layout_the_library_disagrees_with_is_found_and_located(monkeypatch):
  """`mismatch` against a library that writes the metadata in another order (the stand-in
  made to use its natural order): every value byte agrees, metadata bytes do not."""
  with ops.standin():
    assert compression.mismatch(TN, jnp.bfloat16, layout.SM90_16BIT) is None
    monkeypatch.setattr(ops, "standin_layout", lambda gemm, dtype: layout.NATURAL)
    why = compression.mismatch(TN, jnp.bfloat16, layout.SM90_16BIT)
  assert why is not None and why.startswith("0 value and ") and "metadata byte" in why, why


def test_describe_difference_counts_each_section():
  ours = np.zeros(16 * 16 // 2 * 2 + 16 * 16 // 8, np.uint8)   # (16, 16) bf16: 256 + 32 bytes
  theirs = ours.copy()
  assert compression.describe_difference(ours, theirs, 16, 16, 2) is None
  theirs[3], theirs[256 + 5] = 7, 9          # value byte 3, metadata byte 5
  why = compression.describe_difference(ours, theirs, 16, 16, 2)
  assert why.startswith("1 value and 1 metadata bytes differ") and "value byte 3" in why, why
  assert "against 0x07" in why
  assert "bytes against" in compression.describe_difference(ours[:5], theirs, 16, 16, 2)


def _fake_local_h100(monkeypatch):
  dev = types.SimpleNamespace(platform="gpu", compute_capability="9.0",
                              device_kind="NVIDIA H100 80GB HBM3 (fake)")
  monkeypatch.setattr(_common, "target_device", lambda: dev)
  monkeypatch.setattr(compression, "_local_gpu", lambda d: d is dev)
  return dev


@pytest.mark.parametrize("verdict", [None, "3 value and 0 metadata bytes differ"])
def test_on_a_gpu_the_check_runs_once_and_a_mismatch_falls_back(monkeypatch, verdict):
  _fake_local_h100(monkeypatch)
  calls = []

  def fake_mismatch(gemm, dtype, lay):
    calls.append((gemm.m, gemm.k, jnp.dtype(dtype).name, lay.name))
    return verdict

  warnings = []
  monkeypatch.setattr(compression, "mismatch", fake_mismatch)
  monkeypatch.setattr(compression.logging, "warning", lambda *a: warnings.append(a))
  for _ in range(3):
    got = compression.s24jax_layout(TN, jnp.bfloat16)
  assert calls == [(256, 512, "bfloat16", "sm90_16bit")]        # once per process and shape
  assert got is (layout.SM90_16BIT if verdict is None else None)
  assert len(warnings) == (0 if verdict is None else 1)
  compression.s24jax_layout(ops.Gemm(m=512, n=128, k=256, trans_a=True, trans_b=False),
                            jnp.bfloat16)
  assert len(calls) == 2                                        # another shape: its own check


def test_a_compile_only_gpu_takes_the_layout_unchecked(monkeypatch):
  dev = _fake_local_h100(monkeypatch)
  monkeypatch.setattr(compression, "_local_gpu", lambda d: False)
  monkeypatch.setattr(compression, "mismatch", lambda *a: pytest.fail("checked"))
  assert compression.s24jax_layout(TN, jnp.float8_e4m3fn) is layout.SM90_8BIT
  dev.compute_capability = "8.0"
  assert compression.s24jax_layout(TN, jnp.bfloat16) is layout.SM80_16BIT
  assert compression.s24jax_layout(TN, jnp.float8_e4m3fn) is None      # no A100 FP8


# ---------------------------------------------------------------------------------------------
# On a GPU: the bytes against the library, for the steps' types and shape classes.

# (m, k) of the steps' sparse operands: W~ and W~^T of GPT-2 124M's and 1.5B's FFN, Llama 7B's,
# the MVUE estimate (out, tokens), and a few shapes of several tiles that are not powers of two.
STEP_SHAPES = [(3072, 768), (768, 3072), (6400, 1600), (1600, 6400), (11008, 4096),
               (4096, 11008), (3072, 8192), (768, 65536), (384, 640), (192, 1152)]


# The 8-bit layout is a hypothesis (layout.py): on a GPU where the library disagrees, the
# steps compress with the library (compression.py) and this case reports it without failing.
HYPOTHESIS = pytest.mark.xfail(strict=False, reason="sm90 8-bit layout: a hypothesis")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16,
                                   pytest.param(jnp.float8_e4m3fn, marks=HYPOTHESIS),
                                   pytest.param(jnp.float8_e5m2, marks=HYPOTHESIS)],
                         ids=lambda d: jnp.dtype(d).name)
def test_gpu_s24jax_bytes_equal_the_librarys(dtype):
  cc = tuple(int(p) for p in jax.devices()[0].compute_capability.split("."))
  itemsize = jnp.dtype(dtype).itemsize
  checked = 0
  for m, k in STEP_SHAPES:
    lay = layout.for_target(cc, itemsize, m, k)
    if lay is None:
      continue
    gemm = ops.Gemm(m=m, n=256, k=k, trans_a=True, trans_b=False)
    assert compression.mismatch(gemm, dtype, lay) is None, (lay.name, m, k)
    checked += 1
  if not checked:
    pytest.skip(f"no s24jax layout for {jnp.dtype(dtype).name} on compute capability {cc}")
