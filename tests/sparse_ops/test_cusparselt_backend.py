"""Tests of s24jax/sparse_ops/cusparselt.py, sparsity.backend='cusparselt': the wiring around
the cuSPARSELt FFI calls, on CPU.

The FFI handlers need a GPU. Here `cusparselt.standin()` replaces the two FFI calls by jnp
with the same operands, transposes and layouts, under the library's rules
(kernels/cusparselt/rules.py: a GEMM cuSPARSELt would refuse is refused here too): the one
place a test replaces the library. With it, everything s24jax builds around the calls (the
GEMM convention, the three GEMMs, MVUE, FP8, accumulation, `prepare` once per step, the mesh)
is checked against the 'xla' backend, the reference, in bfloat16 (float32 is refused: R7). The handlers and the library themselves:
tests/kernels/test_cusparselt_library.py; the `gpu` tests here run the real calls.
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.extend import core as jax_core

from s24jax import errors
from s24jax.nn import model as model_lib
from s24jax import sparse_ops
from s24jax import state as state_lib
from s24jax.training import train
from s24jax.kernels import masks
from s24jax.kernels.cusparselt import compression
from s24jax.kernels.cusparselt import library
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.training.run_spec import RunSpec
from s24jax.sparse_ops.options import GemmOptions

from tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The cuSPARSELt calls themselves, on every GEMM the backend can run sparse: the run config's
# default, sparsity.gemm_choice='measured', runs the dense GEMMs where nothing was measured
# (off a GPU, always), which would leave these tests comparing 'xla' with itself.
SPARSE = {"sparsity.gemm_choice": "sparse"}


def _devices(n: int) -> str:
  """XLA_FLAGS for n CPU devices, keeping the suite's (conftest.py)."""
  return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _weights(transposable, seed=3, shape=(64, 32)):
  w = _normal(seed, shape)
  mask = masks.transposable_mask(w) if transposable else masks.nm_mask(w)
  return jnp.where(mask, w, 0)


@pytest.mark.parametrize("transposable,mvue,fp8", [(False, False, False), (True, False, False),
                                                   (False, True, False), (True, True, False),
                                                   (False, True, True), (True, True, True)])
@pytest.mark.parametrize("on_tiles", [False, True], ids=["library_compresses", "s24jax_compresses"])
def test_three_gemms_equal_the_xla_backend(transposable, mvue, fp8, on_tiles, monkeypatch):
  """Forward, dX and dW of sparse_linear through the cusparselt wiring (stand-in) against
  'xla' with the same key (the same MVUE estimate) and, under FP8, the same formats (e4m3
  forward, e5m2 backward: one type per GEMM, R1): equal, but for dW with MVUE in bf16,
  which cuSPARSELt writes in bf16 (R2: no bf16 -> f32 kernel) where 'xla' keeps float32.

  Both sides run on the CPU backend, on a GPU host too: the claim is the wiring, and equality
  needs the same arithmetic on both sides. On a GPU the 'xla' reference's FP8 GEMMs are
  tensor-core GEMMs (cuBLASLt; 14-bit accumulation on Hopper) while the stand-in multiplies
  the same FP8 values in float32, so they differ in the accumulation's last bits (the H100
  run of 2026-11-27 failed both FP8 cases here). The real calls against 'xla' on a GPU:
  test_gpu_three_gemms_equal_the_xla_backend.

  `on_tiles`: operands of shapes s24jax's compression writes (kernels/cusparselt/layout.py,
  every operand compressed by jnp in the stand-in's H100 layout, dX TN on W~^T) or too small
  for its tiles (the library's compression, here its stand-in; bf16 dX NN on W~)."""
  if on_tiles:   # no operand reaches the library's compression
    monkeypatch.setattr(cusparselt, "compress", lambda *a, **k: pytest.fail("library compress"))
  with jax.default_device(jax.devices("cpu")[0]):
    _three_gemms_equal_the_xla_backend(transposable, mvue, fp8, on_tiles)


def _three_gemms_equal_the_xla_backend(transposable, mvue, fp8, on_tiles=False):
  t, n, k = (64, 128, 128) if on_tiles else (48, 64, 32)        # (B T / 2, out, in)
  x = _normal(4, (2, t, k), jnp.bfloat16)                       # (B, T, in)
  w = _weights(transposable, shape=(n, k))                      # (out, in)
  dy = _normal(5, (2, t, n), jnp.bfloat16)
  key = jax.random.key(7)

  def grads(backend):
    def f(x, w):
      opts = GemmOptions(mvue=mvue, backend=backend, fp8=fp8, transposable=transposable,
                         fp8_backward_operands="e5m2" if fp8 else "e4m3")
      y = sparse_ops.sparse_linear(x, w, key, opts=opts)
      return jnp.sum((y * dy).astype(jnp.float32)), y
    (_, y), (gx, gw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w)
    return y, gx, gw

  want = jax.jit(lambda: grads("xla"))()   # (XLA:CPU runs a bf16 x bf16 -> f32 dot jitted)
  with cusparselt.standin():
    got = jax.jit(lambda: grads("cusparselt"))()
  for name, a, b in zip(("y", "dX", "dW"), got, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if name == "dW" and mvue and not fp8:   # one bf16 rounding of each entry
      np.testing.assert_allclose(a, b, rtol=2 ** -8, atol=1e-6, err_msg=name)
      assert np.any(a != b), "the bf16 rounding of dW is measured, not absent"
    else:
      np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_gemm_operands_are_what_cusparselt_needs(monkeypatch, fp8):
  """The sparse operand of each GEMM is 2:4 along its contraction dimension: W~ along `in`
  (forward), W~ along `out` (dX, transposable), MVUE(dY^T) along the tokens (dW); the layouts
  are the library's (R3): FP8 all TN, one FP8 type per GEMM; bf16 TN, NN and TT, on W~ and
  x as they are (no transposed copy); dW's D row-major, the others column-major."""
  seen = []
  real = compression.compress

  def spy(a, gemm, **kw):
    op_a = a if gemm.trans_a else a.T                   # (m, k): 2:4 along k
    ok = bool(jnp.all(jnp.sum(op_a.reshape(gemm.m, -1, 4).astype(jnp.float32) != 0, -1) <= 2))
    seen.append((gemm, ok, jnp.dtype(a.dtype).name, jnp.dtype(kw["b_dtype"]).name))
    return real(a, gemm, **kw)

  monkeypatch.setattr(compression, "compress", spy)
  x, w, key = _normal(4, (96, 32), jnp.bfloat16), _weights(True), jax.random.key(1)
  with cusparselt.standin():
    opts = GemmOptions(mvue=True, backend="cusparselt", transposable=True, fp8=fp8,
                       fp8_backward_operands="e5m2" if fp8 else "e4m3")
    jax.grad(lambda w: jnp.sum(sparse_ops.sparse_linear(x, w, key, opts=opts).astype(
        jnp.float32) ** 2))(w)
  by_k = {g.k: (g, ok, a, b) for g, ok, a, b in seen}
  assert sorted(by_k) == [32, 64, 96], seen             # in (fwd), out (dX), tokens (dW)
  assert all(ok for _, ok, _, _ in by_k.values()), seen
  layouts = {k: (g.trans_a, g.trans_b, g.d_row_major) for k, (g, _, _, _) in by_k.items()}
  types = {k: (a, b) for k, (_, _, a, b) in by_k.items()}
  if fp8:
    assert layouts == {32: (True, False, False), 64: (True, False, False),
                       96: (True, False, True)}, layouts
    assert types == {32: ("float8_e4m3fn",) * 2, 64: ("float8_e5m2",) * 2,
                     96: ("float8_e5m2",) * 2}, types
  else:
    assert layouts == {32: (True, False, False), 64: (False, False, False),
                       96: (True, True, True)}, layouts
    assert set(types.values()) == {("bfloat16", "bfloat16")}, types


def test_what_the_library_refuses_is_refused_naming_the_rule():
  """The configurations cuSPARSELt refuses stop before a step runs, each with its rule:
  float32 compute (R7: 1:2 for float32), FP8 with e4m3 backward operands (R1: W~ / x in e4m3
  against dY in e5m2); 'auto' picks e5m2 on cusparselt and keeps e4m3 on 'xla'."""
  from s24jax.nn import sparse_linear   # pylint: disable=g-import-not-at-top
  from s24jax.methods import registry   # pylint: disable=g-import-not-at-top
  ste = registry.get_method("ste")
  auto = sparse_linear.SparsityConfig(method=ste, backend="cusparselt", fp8=True)
  assert auto.gemm.fp8_backward_operands == "e5m2"
  assert sparse_linear.SparsityConfig(method=ste, fp8=True).gemm.fp8_backward_operands == "e4m3"
  with pytest.raises(ValueError, match=r"fp8_backward_operands='e5m2'.*R1"):
    sparse_linear.SparsityConfig(method=ste, backend="cusparselt", fp8=True,
                                 fp8_backward_operands="e4m3")
  with pytest.raises(ValueError, match=r"float32.*1:2.*R7"):
    model_lib.ModelConfig(dtype="float32", sparsity=sparse_linear.SparsityConfig(
        method=ste, backend="cusparselt"))
  # And at the op, for a float32 operand that reaches it anyway.
  x, w = _normal(4, (96, 32)), _weights(False)
  with cusparselt.standin(), pytest.raises(ValueError, match=r"1:2.*R7"):
    sparse_ops.sparse_linear(x, w, None, GemmOptions(backend="cusparselt"))


@pytest.mark.parametrize("method,overrides", [
    ("t_sr_ste", {"sparsity.mvue": True, "sparsity.t_sr_ste.decay": 6e-5, "sparsity.fp8": True,
                  "sparsity.fp8_backward_operands": "e5m2", "grad_accum_steps": 2}),
    ("s_ste", {"sparsity.mvue": True}),
])
def test_tiny_training_equals_the_xla_backend(method, overrides, data_cache):
  """Losses of a few jitted train steps, cusparselt (stand-in) against xla: transposable
  masks (sparse dX), MVUE (sparse dW), FP8 and 2 accumulation micro-batches at once."""
  def losses(backend):
    cfg = tiny_config(method, steps=3, workdir_cache=data_cache,
                      overrides={"batch_size": 8, "sparsity.backend": backend,
                                 "model.dtype": "bfloat16", **SPARSE, **overrides})
    spec = RunSpec.build(cfg)
    model_cfg, tx_fn = spec.model_cfg, spec.tx
    model = model_lib.GPT2(model_cfg)
    state = train.fresh_state(model, tx_fn, 0)
    tx = tx_fn(state.params, state.sparsity)
    rng, out = np.random.default_rng(0), []
    for _ in range(3):
      tok = jnp.asarray(rng.integers(0, 256, (8, 16)), jnp.int32)
      state, m = train.train_step(state, {"inputs": tok, "targets": tok}, model=model, tx=tx,
                                  accum_steps=int(cfg.grad_accum_steps))
      out.append(float(m["loss"] / m["count"]))
    return out

  want = losses("xla")
  with cusparselt.standin():
    got = losses("cusparselt")
  # FP8 with 'auto' backward operands: e5m2 on cusparselt; the xla run is told the same.
  np.testing.assert_allclose(got, want, rtol=2e-3)


_MESH = r"""
import sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp, numpy as np
from s24jax.nn import model as model_lib
from s24jax.training import sharding
from s24jax.training import train
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.training.run_spec import RunSpec
from tiny import tiny_config
assert jax.device_count() == 4
def losses(backend, method, kw):
  cfg = tiny_config(method, steps=3, workdir_cache={cache!r},
                    overrides={{"batch_size": 8, "sparsity.backend": backend,
                               "model.dtype": "bfloat16", "sparsity.gemm_choice": "sparse",
                               **kw}})
  part = sharding.Partitioner(sharding.make_mesh(cfg.mesh))
  spec = RunSpec.build(cfg)
  model_cfg, tx_fn = spec.model_cfg, spec.tx
  model = model_lib.GPT2(model_cfg)
  init = lambda: train.fresh_state(model, tx_fn, 0)
  state = jax.jit(init, out_shardings=part.state_shardings(jax.eval_shape(init)))()
  tx = tx_fn(state.params, state.sparsity)
  rng, out, text = np.random.default_rng(0), [], None
  for _ in range(3):
    tok = jax.device_put(jnp.asarray(rng.integers(0, 256, (8, 16)), jnp.int32), part.batch)
    batch = {{"inputs": tok, "targets": tok}}
    if text is None:
      text = train.train_step.lower(state, batch, model=model, tx=tx,
                                    partitioner=part).as_text()
    state, m = train.train_step(state, batch, model=model, tx=tx, partitioner=part)
    out.append(float(m["loss"] / m["count"]))
  return out, text
for method, kw, tol in (("t_sr_ste", {{"sparsity.t_sr_ste.decay": 6e-5, "sparsity.fp8": True,
                                      "sparsity.fp8_backward_operands": "e5m2"}}, 1e-4),):
  want, _ = losses("xla", method, kw)
  with cusparselt.standin():
    got, text = losses("cusparselt", method, kw)
  np.testing.assert_allclose(got, want, rtol=tol)
  assert "shard_map" in text or "sdy.manual_computation" in text or "custom_call @Sharding" in text
print("OK", got)
"""


@pytest.mark.slow
def test_under_a_mesh_each_device_runs_its_own_shard(tmp_path, data_cache):
  """4 data-parallel devices: the cusparselt op runs under shard_map (each device its own
  tokens), and the losses equal the xla backend's, with FP8 too (one per-tensor scale over
  the devices' shards, as on 'xla')."""
  env = dict(os.environ, XLA_FLAGS=_devices(4),
             JAX_PLATFORMS="cpu")
  script = _MESH.format(tests=os.path.join(REPO, "tests"), cache=data_cache)
  run = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, timeout=600,
                       capture_output=True, text=True)
  assert run.returncode == 0 and "OK" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("transposable,mvue,fp8", [(False, False, False), (True, True, False),
                                                   (False, True, True), (True, True, True)])
def test_gpu_three_gemms_equal_the_xla_backend(transposable, mvue, fp8):
  x = _normal(4, (4, 256, 256), jnp.bfloat16)
  w = _weights(transposable, shape=(512, 256)).astype(jnp.bfloat16)
  dy = _normal(5, (4, 256, 512), jnp.bfloat16)
  key = jax.random.key(7)

  def grads(backend):
    def f(x, w):
      opts = GemmOptions(mvue=mvue, backend=backend, transposable=transposable, fp8=fp8,
                         fp8_backward_operands="e5m2" if fp8 else "e4m3")
      y = sparse_ops.sparse_linear(x, w, key, opts=opts)
      return jnp.sum((y * dy).astype(jnp.float32)), y
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, w)

  (_, y1), g1 = grads("cusparselt")
  (_, y0), g0 = grads("xla")
  for a, b in zip((y1, *g1), (y0, *g0)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=3e-2, atol=3e-1)


@pytest.mark.slow
@pytest.mark.aot
def test_deviceless_h100_compile_has_the_custom_calls(tmp_path, monkeypatch):
  """The planner on the tiny Hu et al. recipe with cusparselt for 8 H100s (no GPU): the real
  handlers registered, 3 custom calls per sparse layer (the spmm of the forward, the
  transposable dX (TN, on W~^T) and the MVUE dW; 2 blocks x 2 FFN matrices, unrolled, no
  remat) and no compression by the library (every operand is on the H100 layout's tiles,
  128 tokens per device: s24jax compresses them all), no all-gather (each device multiplies
  its own tokens)."""
  try:
    library.toolchain()
  except library.Unavailable as e:
    pytest.skip(str(e))
  monkeypatch.setenv("S24JAX_CACHE", str(tmp_path))
  out = tmp_path / "plan.json"
  run = subprocess.run([sys.executable, "-m", "s24jax.perf.plan", "--config",
                        "experiments/gpt2_t_sr_ste_df.py:tiny", "--gpu", "h100", "--devices", "8",
                        "--set", "sparsity.backend=cusparselt", "--set",
                        "sparsity.gemm_choice=sparse", "--no-search", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  import json   # pylint: disable=g-import-not-at-top
  report = json.loads(out.read_text())
  assert report["cusparselt_custom_calls"] == 2 * 2 * 3
  assert report["collectives"]["all-gather"] == 0
  # Every call, read back from the optimized HLO, keeps the library's rules.
  calls = report["cusparselt_calls"]
  assert len(calls) == 2 * 2 * 3 and report["cusparselt_rule_violations"] == 0, calls
  assert {c["target"] for c in calls} == {"cusparselt_spmm"}, calls
  assert all(c["trans_a"] for c in calls), calls          # dX too: TN on W~^T


@pytest.mark.slow
@pytest.mark.aot
def test_deviceless_h100_fp8_compile_keeps_the_library_rules(tmp_path, monkeypatch):
  """The tiny S-STE recipe (FP8, MVUE) with cusparselt for one H100: every cuSPARSELt call in
  the optimized HLO has one FP8 type on both operands, the TN layout, a float32 D; none is
  float32 2:4; and none compresses (s24jax writes every operand in the H100 8-bit layout)."""
  try:
    library.toolchain()
  except library.Unavailable as e:
    pytest.skip(str(e))
  monkeypatch.setenv("S24JAX_CACHE", str(tmp_path))
  out = tmp_path / "plan.json"
  run = subprocess.run([sys.executable, "-m", "s24jax.perf.plan", "--config",
                        "experiments/gpt2_s_ste.py:tiny", "--gpu", "h100", "--set",
                        "sparsity.backend=cusparselt", "--set", "sparsity.gemm_choice=sparse",
                        "--no-search", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
  assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]
  import json   # pylint: disable=g-import-not-at-top
  calls = json.loads(out.read_text())["cusparselt_calls"]
  assert calls and all(c["violation"] is None for c in calls), calls
  assert {c["target"] for c in calls} == {"cusparselt_spmm"}, calls
  for c in calls:
    assert c["a_type"] == c["b_type"] in ("e4m3", "e5m2"), c
    assert (c["trans_a"], c["trans_b"], c["d_type"]) == (True, False, "f32"), c


def _compress_sites(jaxpr, in_loop=False, out=None):
  """(outside, inside) loop bodies: the stand-in's compressions (bitcasts to uint8)."""
  out = out if out is not None else [0, 0]
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name == "bitcast_convert_type"
        and eqn.params.get("new_dtype") == jnp.uint8):
      out[int(in_loop)] += 1
    for sub in jax_core.jaxprs_in_params(eqn.params):
      _compress_sites(sub, in_loop or eqn.primitive.name in ("scan", "while"), out)
  return out


def test_weights_are_compressed_once_per_step_not_per_micro_batch(data_cache):
  """With 4 accumulation micro-batches, W~ is compressed before the accumulation loop (for
  the forward and the transposable dX: 2 per sparse layer), and inside it only the MVUE
  estimate of each micro-batch's dY (1 per layer)."""
  cfg = tiny_config("t_sr_ste", steps=1, workdir_cache=data_cache,
                    overrides={"batch_size": 8, "sparsity.backend": "cusparselt",
                               "sparsity.mvue": True, "model.dtype": "bfloat16", **SPARSE})
  spec = RunSpec.build(cfg)
  model_cfg, tx_fn = spec.model_cfg, spec.tx
  model = model_lib.GPT2(model_cfg)
  state = train.fresh_state(model, tx_fn, 0)
  tok = jnp.zeros((8, 16), jnp.int32)
  with cusparselt.standin():
    jaxpr = jax.make_jaxpr(lambda s, b: train.train_step.__wrapped__(
        s, b, model=model, tx=tx_fn(state.params, state.sparsity), accum_steps=4))(
            state, {"inputs": tok, "targets": tok})
  layers = len(state_lib.sparse_layer_paths(state.sparsity))
  outside, inside = _compress_sites(jaxpr.jaxpr)
  assert layers == 2 and (outside, inside) == (2 * layers, layers), (layers, outside, inside)


@pytest.mark.slow
def test_launch_off_a_gpu_is_one_clear_error(tmp_path, data_cache):
  """The main job with the cusparselt backend on a CPU: a user error (exit 2) before anything
  is written, with the message naming the backend that runs here, not a traceback."""
  cmd = [sys.executable, os.path.join(REPO, "launch.py"), "--config",
         os.path.join(REPO, "experiments", "gpt2_t_sr_ste_df.py") + ":tiny",
         "--workdir", str(tmp_path / "run"), "--config.sparsity.backend=cusparselt",
         f"--config.data.cache_dir={data_cache}", "--config.total_steps=2"]
  run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  out = run.stdout + run.stderr
  assert run.returncode == errors.EXIT_USER, out[-3000:]
  assert "sparsity.backend='xla'" in out and "Traceback" not in out, out[-3000:]
  assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run")
