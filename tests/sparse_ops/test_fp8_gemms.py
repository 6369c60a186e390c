"""Tests of the FP8 path of s24jax.sparse_ops (GemmOptions fp8 / fp8_backward_operands, the
FP8 GEMMs of common.py through the 'xla' backend, and the backends' refusals).

References: an independent simulation of each GEMM (every operand quantize-dequantized in its
format, then a float64 GEMM; `_qdq_plain` writes the per-tensor amax scaling out in NumPy
with ml_dtypes' casts, without s24jax.sparse_ops.fp8), the pre-option backward written with
fp8.fp8_dot_general (bit-identical), the float32 op (relative error bounds), and a tiny
model's float32 loss. The quantization itself: tests/sparse_ops/test_fp8.py.

The simulation is exact; the GEMM is not. On a CPU XLA upcasts the FP8 operands and sums the
(exact) products in float32; on Hopper it runs cuBLASLt's FP8 GEMM, whose tensor cores
accumulate with 14 significant bits and truncate. Each comparison allows
`fp8_gemm_error_bound` (kernels/_testing.py: derived from that arithmetic, per element, from
K and sum |a_i b_i|), on every machine; `test_the_fp8_error_bound_rejects_real_mistakes`
shows it still rejects a wrong format, a dropped weight and a wrong scale.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from s24jax.sparse_ops import fp8
from s24jax.nn import losses as losses_lib
from s24jax.nn import model as model_lib
from s24jax.training import config as config_lib
from s24jax import sparse_ops
from s24jax.training import train
from s24jax.kernels import masks
from s24jax.kernels._testing import assert_within_bound
from s24jax.kernels._testing import bound_violations
from s24jax.kernels._testing import fp8_gemm_error_bound
from s24jax.training.run_spec import RunSpec
from s24jax.nn.sparse_linear import SparsityConfig
from s24jax.sparse_ops.options import GemmOptions


def _sparse_op_inputs(seed=0):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(k1, (4, 8, 64))                                      # (B, T, in)
  w = masks.soft_threshold24(jax.random.normal(k2, (48, 64)) * 0.05)    # (out, in) 2:4
  dy = jax.random.normal(k3, (4, 8, 48))                                     # (B, T, out)
  return x, w, dy


def _op_outputs(x, w, dy, key=None, **options):
  """y, dX, dW~ of the sparse op with GemmOptions(**options) (cotangent dy)."""
  opts = GemmOptions(**options)

  @jax.jit
  def run(x, w, dy, key):
    y, vjp = jax.vjp(lambda x, w: sparse_ops.sparse_linear(x, w, key, opts=opts), x, w)
    return (y,) + vjp(dy)
  return run(x, w, dy, key)


def _qdq(a, dtype):
  q, s = fp8.quantize(a, dtype)
  return np.asarray(q).astype(np.float64) / float(s)


def _assert_fp8_gemm(got, a, b, what):
  """got = a @ b (the dequantized operands) within the FP8 GEMM's error bound."""
  assert_within_bound(got, a @ b, fp8_gemm_error_bound(a, b), what)


@pytest.mark.parametrize("mvue", [False, True])
def test_sparse_op_fp8_uses_e4m3_forward_e5m2_gradients(mvue):
  # Independent simulation: quantize-dequantize each GEMM operand in its format, float64 GEMM.
  x, w, dy = _sparse_op_inputs()
  key = jax.random.PRNGKey(7)
  y, dx, dw = _op_outputs(x, w, dy, key, mvue=mvue, fp8=True)
  x2, dy2 = x.reshape(-1, 64), dy.reshape(-1, 48)                            # (N, in), (N, out)
  dy_t = masks.mvue24(key, dy2.T) if mvue else dy2.T                         # (out, N)
  _assert_fp8_gemm(y.reshape(-1, 48), _qdq(x2, fp8.E4M3), _qdq(w, fp8.E4M3).T, "y")
  _assert_fp8_gemm(dx.reshape(-1, 64), _qdq(dy2, fp8.E5M2), _qdq(w, fp8.E4M3), "dX")
  _assert_fp8_gemm(dw, _qdq(dy_t, fp8.E5M2), _qdq(x2, fp8.E4M3), "dW")


def test_the_fp8_error_bound_rejects_real_mistakes():
  """The bound the comparisons above allow (tensor-core FP8 accumulation) is still far below
  what a real mistake in the forward GEMM moves: x quantized in e5m2 instead of e4m3, the
  largest weight dropped, the dequantizing scale off by a factor 2. Each lands outside it."""
  x, w, _ = _sparse_op_inputs()
  x2 = x.reshape(-1, 64)                                                     # (N, in)
  xq, wq = _qdq(x2, fp8.E4M3), _qdq(w, fp8.E4M3)
  want, bound = xq @ wq.T, fp8_gemm_error_bound(xq, wq.T)                   # (N, out)
  y = _op_outputs(x, w, jnp.zeros((4, 8, 48)), fp8=True)[0].reshape(-1, 48)
  assert not bound_violations(y, want, bound).any()
  dropped = wq.copy()
  dropped[np.unravel_index(np.argmax(np.abs(wq)), wq.shape)] = 0
  mistakes = {"x in e5m2": _qdq(x2, fp8.E5M2) @ wq.T, "a weight dropped": xq @ dropped.T,
              "scale x 2": 2 * want}
  for name, wrong in mistakes.items():
    assert bound_violations(wrong, want, bound).any(), name


# sparsity.fp8_backward_operands: W~ and x in the two backward GEMMs.


def _qdq_plain(a, np_dtype) -> np.ndarray:
  """Per-tensor amax quantize-dequantize written out in numpy (no s24jax.sparse_ops.fp8): scale =
  fmax / amax, saturate, round to nearest even by ml_dtypes' cast, divide back."""
  a = np.asarray(a, np.float32)
  m = float(ml_dtypes.finfo(np_dtype).max)
  scale = np.float32(m / np.abs(a).max())
  q = np.clip(a * scale, -m, m).astype(np_dtype)
  return q.astype(np.float64) / np.float64(scale)


@pytest.mark.parametrize("mvue", [False, True])
def test_sparse_op_e5m2_backward_operands_requantize_w_and_x(mvue):
  x, w, dy = _sparse_op_inputs()
  key = jax.random.PRNGKey(7)
  e4, e5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
  y, dx, dw = _op_outputs(x, w, dy, key, mvue=mvue, fp8=True, fp8_backward_operands="e5m2")
  y4, dx4, dw4 = _op_outputs(x, w, dy, key, mvue=mvue, fp8=True)
  x2, dy2 = x.reshape(-1, 64), dy.reshape(-1, 48)                            # (N, in), (N, out)
  dy_t = masks.mvue24(key, dy2.T) if mvue else dy2.T                         # (out, N)
  # Forward unchanged: e4m3 x e4m3, bit for bit the default's.
  np.testing.assert_array_equal(y, y4)
  _assert_fp8_gemm(y.reshape(-1, 48), _qdq_plain(x2, e4), _qdq_plain(w, e4).T, "y")
  # Backward: dY, W~ and x all e5m2, each with its own per-tensor amax scale.
  _assert_fp8_gemm(dx.reshape(-1, 64), _qdq_plain(dy2, e5), _qdq_plain(w, e5), "dX")  # (N, in)
  _assert_fp8_gemm(dw, _qdq_plain(dy_t, e5), _qdq_plain(x2, e5), "dW")              # (out, in)
  # And not the e4m3-operand gradients: the re-quantization moves them by far more than the
  # error bound above (one mantissa bit less on W~ / x: ~6% here).
  for got, default in ((dx, dx4), (dw, dw4)):
    rel = float(jnp.linalg.norm(got - default) / jnp.linalg.norm(default))
    assert rel > 2e-2, rel


def test_sparse_op_fp8_backward_operands_default_is_todays_e4m3():
  # Unset, "e4m3", and the pre-option backward written with fp8.fp8_dot_general (e5m2 dY x
  # e4m3 W~ / x): bit-identical.
  x, w, dy = _sparse_op_inputs(1)
  unset = _op_outputs(x, w, dy, fp8=True)
  e4m3 = _op_outputs(x, w, dy, fp8=True, fp8_backward_operands="e4m3")
  for a, b in zip(unset, e4m3):
    np.testing.assert_array_equal(a, b)

  @jax.jit
  def before(x, w, dy):
    x2, dy2 = x.reshape(-1, 64), dy.reshape(-1, 48)
    dims = (((1,), (0,)), ((), ()))
    dx = fp8.fp8_dot_general(dy2, w, dims, a_dtype=fp8.E5M2, b_dtype=fp8.E4M3,
                             out_dtype=jnp.float32)
    dw = fp8.fp8_dot_general(dy2.T, x2, dims, a_dtype=fp8.E5M2, b_dtype=fp8.E4M3,
                             out_dtype=jnp.float32)
    return dx.reshape(x.shape), dw
  for a, b in zip(unset[1:], before(x, w, dy)):
    np.testing.assert_array_equal(a, b)


def test_fp8_backward_operands_bad_values_are_refused():
  # The options themselves (options.py): an unknown format, and e5m2 without FP8.
  with pytest.raises(ValueError, match="unknown sparsity.fp8_backward_operands 'e4m3fn'; "
                                       "valid: e4m3, e5m2"):
    GemmOptions(fp8=True, fp8_backward_operands="e4m3fn")
  with pytest.raises(ValueError, match="valid: auto, e4m3, e5m2"):
    SparsityConfig(fp8=True, fp8_backward_operands="E5M2")
  # cuSPARSELt takes one FP8 type per GEMM (rules R1): e4m3 W~ / x against e5m2 dY is
  # refused, with the reason and the valid choice, when the options are checked and when the
  # model config is built; 'auto' picks e5m2 there.
  opts = GemmOptions(backend="cusparselt", fp8=True, fp8_backward_operands="e4m3")
  with pytest.raises(ValueError, match="(?s)backend='cusparselt'.*'e5m2'.*one FP8 type per GEMM"):
    sparse_ops.check(opts)
  with pytest.raises(ValueError, match="backend='cusparselt'"):
    SparsityConfig(backend="cusparselt", fp8=True, fp8_backward_operands="e4m3")
  sparse_ops.check(GemmOptions(backend="cusparselt", fp8=True, fp8_backward_operands="e5m2"))
  assert SparsityConfig(backend="cusparselt", fp8=True).gemm.fp8_backward_operands == "e5m2"
  sparse_ops.check(GemmOptions(backend="xla", fp8=True, fp8_backward_operands="e5m2"))
  # Without FP8 the option would do nothing: refused rather than ignored.
  with pytest.raises(ValueError, match="sparsity.fp8 is False"):
    GemmOptions(fp8_backward_operands="e5m2")
  with pytest.raises(ValueError, match="sparsity.fp8 is False"):
    SparsityConfig(fp8_backward_operands="e5m2")
  # The Pallas and tcgen05 backends have no FP8 path at all (their own error).
  for backend in ("pallas", "pallas_always", "tcgen05"):
    match = (f"sparsity.fp8 is not supported by sparsity.backend='{backend}' \\(its kernels "
             "have no FP8 path\\); use sparsity.backend='xla' or 'cusparselt'.")
    with pytest.raises(ValueError, match=match):
      sparse_ops.check(GemmOptions(backend=backend, fp8=True, fp8_backward_operands="e5m2"))
    with pytest.raises(ValueError, match=match):
      SparsityConfig(backend=backend, fp8=True)


def test_sparse_op_fp8_gradients_close_to_float32():
  errors = {"y": [], "dx": [], "dw": []}
  for seed in range(3):
    x, w, dy = _sparse_op_inputs(seed)
    with jax.default_matmul_precision("highest"):   # float32, not a GPU's default TF32
      ref = _op_outputs(x, w, dy)
    got = _op_outputs(x, w, dy, fp8=True)
    for name, r, g in zip(errors, ref, got):
      errors[name].append(float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)))
  # e4m3 x e4m3 forward; e5m2 x e4m3 gradients (half the mantissa bits of e4m3, ~2x error).
  assert max(errors["y"]) <= 0.05, errors
  assert max(errors["dx"]) <= 0.09 and max(errors["dw"]) <= 0.09, errors
  assert min(min(v) for v in errors.values()) > 1e-3, errors   # FP8 really is on


def test_model_trains_with_fp8():
  # Both FFN layers through the FP8 op (with MVUE): the loss at init is close to the fp32
  # model's, and a few steps on one batch bring it down.
  c = config_lib.apply_variant(config_lib.base_config(), "tiny")
  c.sparsity.method, c.sparsity.fp8, c.sparsity.mvue = "s_ste", True, True
  c.model.vocab_size, c.model.seq_len = 64, 8
  c.model.num_layers, c.model.num_heads, c.model.d_model = 1, 2, 16
  c.optim.warmup_steps, c.optim.lr = 1, 1e-2
  spec = RunSpec.build(c)
  model_cfg, tx_fn = spec.model_cfg, spec.tx
  model = model_lib.GPT2(model_cfg)
  state = jax.jit(lambda: train.fresh_state(model, tx_fn, 0))()
  tokens = np.random.default_rng(0).integers(0, 64, size=(4, 9))
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
  c.sparsity.fp8 = False
  fp32_model = model_lib.GPT2(RunSpec.build(c).model_cfg)
  fp32_logits = jax.jit(fp32_model.apply)({"params": state.params, "sparsity": state.sparsity},
                                          batch["inputs"])
  fp32_loss = (float(losses_lib.cross_entropy_sum(fp32_logits, batch["targets"]))
               / batch["targets"].size)
  tx = tx_fn(state.params, state.sparsity)
  losses = []
  for _ in range(4):
    state, m = train.train_step(state, batch, model=model, tx=tx)
    losses.append(float(m["loss"] / m["count"]))
  assert np.all(np.isfinite(losses))
  np.testing.assert_allclose(losses[0], fp32_loss, rtol=1e-2)
  assert losses[0] != fp32_loss            # FP8 really changed the forward
  assert losses[-1] < losses[0] - 0.05, losses
