"""Tests for s24jax.fp8: per-tensor amax quantization and FP8 GEMMs.

The rounding reference is a brute force over all 256 bit patterns of each float8 format
(nearest finite value, ties to the even bit pattern), not a cast.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from s24jax import fp8
from s24jax.kernels import masks
from s24jax import sparse_ops
from s24jax.methods import s_ste

FORMATS = [(fp8.E4M3, ml_dtypes.float8_e4m3fn, 3), (fp8.E5M2, ml_dtypes.float8_e5m2, 2)]


def _finite_values(np_dtype) -> tuple[np.ndarray, np.ndarray]:
  """All finite values of a float8 format (float64) and their bit patterns."""
  bits = np.arange(256, dtype=np.uint8)
  values = bits.view(np_dtype).astype(np.float64)
  keep = np.isfinite(values)
  return values[keep], bits[keep]


def _round_brute_force(x: np.ndarray, np_dtype) -> np.ndarray:
  """Nearest finite float8 value of each x (already within +-fmax); ties to the even pattern."""
  values, bits = _finite_values(np_dtype)
  dist = np.abs(x.reshape(-1, 1).astype(np.float64) - values[None, :])   # (n, 256)
  best = dist.min(axis=1, keepdims=True)
  ties = dist == best
  # Among the tied candidates prefer an even bit pattern (round half to even).
  pref = np.where(ties, np.where(bits[None, :] % 2 == 0, 0, 1), 2)
  return values[np.argmin(pref, axis=1)].reshape(x.shape)


@pytest.mark.parametrize("dtype,np_dtype,mbits", FORMATS)
def test_quantize_matches_brute_force_rounding(dtype, np_dtype, mbits):
  del mbits
  x = np.array(jax.random.normal(jax.random.PRNGKey(0), (33, 7)) * 3.0)
  x[0, :3] = [0.0, -1e-12, 1e-30]      # zero, and values that flush to zero
  q, scale = fp8.quantize(jnp.asarray(x), dtype)
  assert q.dtype == jnp.dtype(dtype)
  np.testing.assert_allclose(float(scale), fp8.fmax(dtype) / np.abs(x).max(), rtol=1e-6)
  want = _round_brute_force(np.float32(x) * np.float32(scale), np_dtype)
  np.testing.assert_array_equal(np.asarray(q).astype(np.float64), want)


@pytest.mark.parametrize("dtype,np_dtype,mbits", FORMATS)
def test_round_trip_within_format_precision(dtype, np_dtype, mbits):
  # Magnitudes over 12 binades below amax, random signs.
  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  x = jnp.exp2(jax.random.uniform(k1, (4096,), minval=-12.0, maxval=0.0))
  x = jnp.where(jax.random.bernoulli(k2, 0.5, x.shape), x, -x) * 5.0
  q, scale = fp8.quantize(x, dtype)
  back = np.asarray(fp8.dequantize(q, scale))
  x, scaled = np.asarray(x), np.abs(np.asarray(x)) * float(scale)
  normal = scaled >= float(jnp.finfo(dtype).tiny)
  rel = np.abs(back - x)[normal] / np.abs(x)[normal]
  # Round to nearest: half an ulp, 2^-(mbits+1) (e4m3: 2^-4, e5m2: 2^-3), tighter than one ulp.
  assert rel.max() <= 2.0 ** -(mbits + 1) * (1 + 1e-6)
  assert rel.max() > 2.0 ** -(mbits + 3)      # and the rounding is really there
  # Subnormals: absolute error at most half the subnormal spacing, in x's units.
  sub_step = float(jnp.finfo(dtype).smallest_subnormal)
  assert np.all(np.abs(back - x)[~normal] <= 0.5 * sub_step / float(scale) * (1 + 1e-6))


@pytest.mark.parametrize("dtype,np_dtype,mbits", FORMATS)
def test_amax_maps_to_max_finite_value(dtype, np_dtype, mbits):
  del np_dtype, mbits
  x = jnp.array([[0.5, -3.25, 1.0], [2.0, 0.1, -0.7]])
  q, scale = fp8.quantize(x, dtype)
  assert float(q[0, 1]) == -fp8.fmax(dtype)
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == fp8.fmax(dtype)
  np.testing.assert_allclose(float(fp8.dequantize(q, scale)[0, 1]), -3.25, rtol=1e-6)


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_quantize_saturates_instead_of_nan(dtype):
  x = jnp.array([1.0, -1.0, 1e3, -1e6])
  q, _ = fp8.quantize(x, dtype, scale=jnp.float32(1e3))   # way out of range
  assert not bool(jnp.any(jnp.isnan(q.astype(jnp.float32))))
  np.testing.assert_array_equal(np.abs(np.asarray(q.astype(jnp.float32)))[2:],
                                fp8.fmax(dtype))


def test_zero_tensor_quantizes_to_zero_with_unit_scale():
  q, scale = fp8.quantize(jnp.zeros((3, 4)), fp8.E4M3)
  assert float(scale) == 1.0
  assert not bool(jnp.any(q.astype(jnp.float32)))


def test_unknown_format_is_rejected():
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    fp8.quantize(jnp.ones(3), jnp.bfloat16)


@pytest.mark.parametrize("a_dtype,b_dtype", [(fp8.E4M3, fp8.E4M3), (fp8.E5M2, fp8.E4M3)])
def test_fp8_dot_equals_dequantized_float64_product(a_dtype, b_dtype):
  k1, k2 = jax.random.split(jax.random.PRNGKey(2))
  a = jax.random.normal(k1, (3, 5, 32))
  b = jax.random.normal(k2, (32, 24)) * 0.02
  got = np.asarray(fp8.fp8_dot(a, b, a_dtype=a_dtype, b_dtype=b_dtype))
  assert got.shape == (3, 5, 24) and got.dtype == np.float32
  qa, sa = fp8.quantize(a, a_dtype)
  qb, sb = fp8.quantize(b, b_dtype)
  deq_a = np.asarray(qa).astype(np.float64) / float(sa)
  deq_b = np.asarray(qb).astype(np.float64) / float(sb)
  np.testing.assert_allclose(got, deq_a @ deq_b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("a_dtype,bound", [(fp8.E4M3, 0.05), (fp8.E5M2, 0.09)])
def test_fp8_dot_relative_error_to_float32(a_dtype, bound):
  # Gaussian operands: per-element relative rounding error ~2^-(m+1)/sqrt(3) each, so the
  # product's relative Frobenius error is a few percent (e4m3) / twice that (e5m2 x e4m3).
  errors = []
  for seed in range(3):
    k1, k2 = jax.random.split(jax.random.PRNGKey(10 + seed))
    a = jax.random.normal(k1, (64, 128))
    b = jax.random.normal(k2, (128, 48))
    exact = a @ b
    got = fp8.fp8_dot(a, b, a_dtype=a_dtype)
    errors.append(float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact)))
  assert max(errors) <= bound, errors
  assert min(errors) > 1e-3, errors   # it is really quantized


def test_fp8_dot_rejects_mismatched_contraction():
  with pytest.raises(ValueError, match="contraction"):
    fp8.fp8_dot(jnp.ones((2, 8)), jnp.ones((4, 3)))


# ---------------------------------------------------------------------------------------------
# The FP8 path of the three-GEMM sparse linear op (sparsity.fp8).


def _sparse_op_inputs(seed=0):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(k1, (4, 8, 64))                                      # (B, T, in)
  w = s_ste.soft_threshold24(jax.random.normal(k2, (48, 64)) * 0.05)   # (out, in) 2:4
  dy = jax.random.normal(k3, (4, 8, 48))                                     # (B, T, out)
  return x, w, dy


def _op_outputs(x, w, dy, key=None, **kwargs):
  @jax.jit
  def run(x, w, dy, key):
    y, vjp = jax.vjp(lambda x, w: sparse_ops.sparse_linear(x, w, key, **kwargs), x, w)
    return (y,) + vjp(dy)
  return run(x, w, dy, key)


def _qdq(a, dtype):
  q, s = fp8.quantize(a, dtype)
  return np.asarray(q).astype(np.float64) / float(s)


@pytest.mark.parametrize("mvue", [False, True])
def test_sparse_op_fp8_uses_e4m3_forward_e5m2_gradients(mvue):
  # Independent simulation: quantize-dequantize each GEMM operand in its format, float64 GEMM.
  x, w, dy = _sparse_op_inputs()
  key = jax.random.PRNGKey(7)
  y, dx, dw = _op_outputs(x, w, dy, key, mvue=mvue, fp8=True)
  x2, dy2 = x.reshape(-1, 64), dy.reshape(-1, 48)                            # (N, in), (N, out)
  dy_t = masks.mvue24(key, dy2.T) if mvue else dy2.T                         # (out, N)
  np.testing.assert_allclose(y.reshape(-1, 48), _qdq(x2, fp8.E4M3) @ _qdq(w, fp8.E4M3).T,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx.reshape(-1, 64), _qdq(dy2, fp8.E5M2) @ _qdq(w, fp8.E4M3),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, _qdq(dy_t, fp8.E5M2) @ _qdq(x2, fp8.E4M3), rtol=1e-5,
                             atol=1e-5)



# sparsity.fp8_backward_operands: W~ and x in the two backward GEMMs.


def _qdq_plain(a, np_dtype) -> np.ndarray:
  """Per-tensor amax quantize-dequantize written out in numpy (no s24jax.fp8): scale =
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
  np.testing.assert_allclose(y.reshape(-1, 48), _qdq_plain(x2, e4) @ _qdq_plain(w, e4).T,
                             rtol=1e-5, atol=1e-5)
  # Backward: dY, W~ and x all e5m2, each with its own per-tensor amax scale.
  want_dx = _qdq_plain(dy2, e5) @ _qdq_plain(w, e5)                          # (N, in)
  want_dw = _qdq_plain(dy_t, e5) @ _qdq_plain(x2, e5)                        # (out, in)
  np.testing.assert_allclose(dx.reshape(-1, 64), want_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)
  # And not the e4m3-operand gradients: the re-quantization moves them by far more than the
  # tolerance above (one mantissa bit less on W~ / x: ~6% here).
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
  from s24jax.sparse_linear import SparsityConfig  # pylint: disable=g-import-not-at-top
  x, w = jnp.ones((4, 8)), jnp.ones((4, 8))
  with pytest.raises(ValueError, match="unknown sparsity.fp8_backward_operands 'e4m3fn'; "
                                       "valid: e4m3, e5m2"):
    sparse_ops.sparse_linear(x, w, fp8=True, fp8_backward_operands="e4m3fn")
  with pytest.raises(ValueError, match="valid: e4m3, e5m2"):
    SparsityConfig(fp8=True, fp8_backward_operands="E5M2")
  # cuSPARSELt has no e5m2 x e5m2 GEMM: refused, with the reason and the valid choice.
  with pytest.raises(ValueError, match="(?s)backend='cusparselt'.*one e4m3 operand.*'e4m3'"):
    sparse_ops.sparse_linear(x, w, backend="cusparselt", fp8=True,
                             fp8_backward_operands="e5m2")
  with pytest.raises(ValueError, match="backend='cusparselt'"):
    SparsityConfig(backend="cusparselt", fp8=True, fp8_backward_operands="e5m2")
  # Without FP8 the option would do nothing: refused rather than ignored.
  with pytest.raises(ValueError, match="sparsity.fp8 is False"):
    sparse_ops.sparse_linear(x, w, fp8_backward_operands="e5m2")
  # The Pallas and tcgen05 backends have no FP8 path at all (their own error).
  with pytest.raises(ValueError, match="fp8 needs sparsity.backend='xla' or 'cusparselt'"):
    sparse_ops.sparse_linear(x, w, backend="tcgen05", fp8=True, fp8_backward_operands="e5m2")


def test_config_fp8_backward_operands_reaches_the_sparse_layers():
  # base_config's field through loop.build / model_config to the FFN layers' op: the same
  # loss (forward unchanged), other FFN kernel gradients (the backward GEMMs' operands).
  from s24jax import config as config_lib, loop  # pylint: disable=g-import-not-at-top
  from s24jax import losses as losses_lib, model as model_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.apply_variant(config_lib.base_config(), "tiny")
  assert c.sparsity.fp8_backward_operands == "e4m3"
  c.sparsity.method, c.sparsity.fp8 = "s_ste", True
  c.model.vocab_size, c.model.seq_len = 64, 8
  c.model.num_layers, c.model.num_heads, c.model.d_model = 1, 2, 16
  tokens = np.random.default_rng(0).integers(0, 64, size=(4, 9))
  inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
  results = {}
  for fmt in ("e4m3", "e5m2"):
    c.sparsity.fp8_backward_operands = fmt
    model_cfg = loop.build(c)[1]
    assert model_cfg.sparsity.fp8_backward_operands == fmt
    model = model_lib.GPT2(model_cfg)
    variables = model.init(jax.random.PRNGKey(0), inputs)

    def loss(params, variables=variables, model=model):
      logits = model.apply({**variables, "params": params}, inputs)
      return losses_lib.cross_entropy_sum(logits, targets)
    results[fmt] = jax.jit(jax.value_and_grad(loss))(variables["params"])
  (l4, g4), (l5, g5) = results["e4m3"], results["e5m2"]
  assert float(l4) == float(l5)                          # the forward is the same
  fc4, fc5 = g4["h_0"]["mlp"]["fc"]["kernel"], g5["h_0"]["mlp"]["fc"]["kernel"]
  assert not np.array_equal(fc4, fc5)                    # the backward is not
  np.testing.assert_allclose(fc5, fc4, rtol=0.2, atol=0.2 * float(jnp.abs(fc4).max()))
  c.sparsity.fp8_backward_operands = "e5m3"
  with pytest.raises(ValueError, match="valid: e4m3, e5m2"):
    loop.build(c)

def test_sparse_op_fp8_gradients_close_to_float32():
  errors = {"y": [], "dx": [], "dw": []}
  for seed in range(3):
    x, w, dy = _sparse_op_inputs(seed)
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
  from s24jax import config as config_lib, loop, train  # pylint: disable=g-import-not-at-top
  from s24jax import losses as losses_lib, model as model_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.apply_variant(config_lib.base_config(), "tiny")
  c.sparsity.method, c.sparsity.fp8, c.sparsity.mvue = "s_ste", True, True
  c.model.vocab_size, c.model.seq_len = 64, 8
  c.model.num_layers, c.model.num_heads, c.model.d_model = 1, 2, 16
  c.optim.warmup_steps, c.optim.lr = 1, 1e-2
  _, model_cfg, tx_fn = loop.build(c)
  model = model_lib.GPT2(model_cfg)
  state = jax.jit(lambda: train.fresh_state(model, tx_fn, 0))()
  tokens = np.random.default_rng(0).integers(0, 64, size=(4, 9))
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
  c.sparsity.fp8 = False
  fp32_model = model_lib.GPT2(loop.build(c)[1])
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
