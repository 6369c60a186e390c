"""Tests of s24jax.nn.sparse_linear: the SparseLinear layer (the one matmul dispatch point), the
tied sparse head, `prepare` (the 'prepared' collection of a backend that compresses W~) and
the frozen SparsityConfig (its validation and its GemmOptions, `.gemm`).

References: plain jnp written from the formulas at HIGHEST precision (y = x (m W)^T + b,
dX = dY (m W), dW = dY^T x for a straight-through projection, db = sum dY), masks recomputed
with kernels.masks, the bytes of the cuSPARSELt stand-in's "compressed" buffer decoded back to
W~ (kernels/cusparselt/ops.py), and the GemmOptions a recording `sparse_ops.sparse_linear`
receives from every sparse layer.
"""
from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from s24jax.training import config as config_lib
from s24jax.nn import losses as losses_lib
from s24jax.nn import model as model_lib
from s24jax.nn import sparse_linear
from s24jax import sparse_ops
from s24jax import state as state_lib
from s24jax.training import train
from s24jax.kernels import masks
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.sparse_ops import cusparselt_gemms as cslt_gemms
from s24jax.methods import registry
from s24jax.nn.model import GPT2
from s24jax.training.run_spec import RunSpec
from s24jax.nn.sparse_linear import SparseLinear
from s24jax.nn.sparse_linear import SparsityConfig

from tiny import tiny_config

HI = jax.lax.Precision.HIGHEST


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _mm(a, b):
  return jnp.matmul(a, b, precision=HI)


def _tiny(method, overrides=None):
  c = tiny_config(method, overrides=overrides)
  c.model.vocab_size = 64
  return c


# ---------------------------------------------------------------------------------------------
# The layer.


@pytest.mark.usefixtures("f32_dots")   # float32 references (a GPU's default is TF32)
def test_sparse_linear_layer_gradients_equal_dense_masked_reference():
  """Through SparseLinear (the dispatch point) with t_sr_ste, MVUE off: all three GEMMs."""
  cfg = SparsityConfig(method=registry.get_method("t_sr_ste"), sparse_layers=("*",))
  layer = SparseLinear(8, cfg, name="fc")
  x = _normal(0, (2, 4, 12))                                     # (B, T, in)
  variables = flax.core.unfreeze(layer.init(jax.random.PRNGKey(1), x))
  w = variables["params"]["kernel"]                              # (out=8, in=12)
  variables["params"]["bias"] = _normal(7, (8,))
  m = masks.transposable_mask(w)
  np.testing.assert_array_equal(variables["sparsity"]["mask"], m)
  dy = _normal(2, (2, 4, 8))                                     # (B, T, out)

  def f(params, x):
    return layer.apply({"params": params, "sparsity": variables["sparsity"]}, x)

  y, vjp = jax.vjp(f, variables["params"], x)
  dparams, dx = vjp(dy)

  wt = jnp.where(m, w, 0.0)                                      # m (.) W, 2:4 both ways
  x2, dy2 = x.reshape(8, 12), dy.reshape(8, 8)
  np.testing.assert_allclose(y, (_mm(x2, wt.T) + variables["params"]["bias"]).reshape(2, 4, 8),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, _mm(dy2, wt).reshape(2, 4, 12), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dparams["kernel"], _mm(dy2.T, x2), rtol=1e-5, atol=1e-5)  # STE
  np.testing.assert_allclose(dparams["bias"], dy2.sum(0), rtol=1e-5, atol=1e-5)       # dense


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_gated_ffn_has_all_matrices_24_sparse(activation):
  c = _tiny("t_sr_ste", {"model.activation": activation})
  model = GPT2(model_lib.model_config(c))
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))
  C, H = c.model.d_model, int(c.model.mlp_ratio * c.model.d_model)
  fc = variables["params"]["h_0"]["mlp"]["fc"]["kernel"]
  assert fc.shape == (2 * H, C)     # [value | gate] rows: one (2H, C) kernel, 2:4 along C
  wts = {}
  for name, shape in (("fc", (2 * H, C)), ("proj", (C, H))):
    kernel = variables["params"]["h_0"]["mlp"][name]["kernel"]
    m = np.asarray(variables["sparsity"]["h_0"]["mlp"][name]["mask"])
    assert m.shape == shape
    assert model.config.sparsity.method.name == "t_sr_ste"
    wts[name] = np.asarray(model.config.sparsity.method.project(
        kernel, variables["sparsity"]["h_0"]["mlp"][name]))
  # The three FFN matrices: value (fc rows :H), gate (fc rows H:), proj; each 2:4 along its
  # contraction axis `in` and (transposable) along `out`.
  for wt in (wts["fc"][:H], wts["fc"][H:], wts["proj"]):
    nz = wt != 0
    assert (nz.reshape(wt.shape[0], -1, 4).sum(-1) == 2).all()
    assert (nz.T.reshape(wt.shape[1], -1, 4).sum(-1) == 2).all()


def test_config_fp8_backward_operands_reaches_the_sparse_layers():
  # base_config's field through RunSpec.build / model_config to the FFN layers' op: the same
  # loss (forward unchanged), other FFN kernel gradients (the backward GEMMs' operands).
  c = config_lib.apply_variant(config_lib.base_config(), "tiny")
  assert c.sparsity.fp8_backward_operands == "auto"   # 'e4m3' on 'xla'
  c.sparsity.method, c.sparsity.fp8 = "s_ste", True
  assert RunSpec.build(c).model_cfg.sparsity.gemm.fp8_backward_operands == "e4m3"
  c.sparsity.method, c.sparsity.fp8 = "s_ste", True
  c.model.vocab_size, c.model.seq_len = 64, 8
  c.model.num_layers, c.model.num_heads, c.model.d_model = 1, 2, 16
  tokens = np.random.default_rng(0).integers(0, 64, size=(4, 9))
  inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
  results = {}
  for fmt in ("e4m3", "e5m2"):
    c.sparsity.fp8_backward_operands = fmt
    model_cfg = RunSpec.build(c).model_cfg
    assert model_cfg.sparsity.fp8_backward_operands == fmt
    assert model_cfg.sparsity.gemm.fp8_backward_operands == fmt
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
  with pytest.raises(ValueError, match="valid: auto, e4m3, e5m2"):
    RunSpec.build(c)


# ---------------------------------------------------------------------------------------------
# SparsityConfig: validation and the GEMM options of every sparse layer.


@pytest.mark.parametrize("field,value,match", [
    ("dense_finetune_fraction", 1.5, r"sparsity.dense_finetune_fraction must be in \[0, 1\)"),
    ("dense_finetune_fraction", -0.1, r"sparsity.dense_finetune_fraction must be in \[0, 1\)"),
    ("dense_finetune_fraction", 1.0, r"sparsity.dense_finetune_fraction must be in \[0, 1\)"),
    ("flip_rate_warn", -0.01, r"sparsity.flip_rate_warn must be >= 0"),
    ("flip_rate_warn_patience", 0, r"sparsity.flip_rate_warn_patience"),
    ("flip_rate_warn_patience", -2, r"sparsity.flip_rate_warn_patience"),
    ("dense_finetune_init", "random", r"unknown sparsity.dense_finetune_init 'random'"),
])
def test_sparsity_config_refuses_bad_values_naming_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    SparsityConfig(method=registry.get_method("ste"), **{field: value})


def test_sparsity_config_accepts_the_edges():
  ste = registry.get_method("ste")
  for kw in (dict(dense_finetune_fraction=0.0), dict(dense_finetune_fraction=0.99),
             dict(flip_rate_warn=0.0), dict(flip_rate_warn_patience=1)):
    cfg = SparsityConfig(method=ste, **kw)
    for field, value in kw.items():
      assert getattr(cfg, field) == value


def test_gemm_options_carry_transposable_from_the_method():
  for name, transposable in (("t_sr_ste", True), ("ste", False), ("s_ste", False)):
    method = registry.get_method(name)
    assert method.transposable == transposable
    cfg = SparsityConfig(method=method, mvue=True, fp8=True, fp8_backward_operands="e5m2")
    assert cfg.gemm == sparse_ops.GemmOptions(mvue=True, fp8=True, fp8_backward_operands="e5m2",
                                              backend="xla", transposable=transposable,
                                              gemm_choice="measured")


def _recording_sparse_linear(monkeypatch):
  """sparse_ops.sparse_linear, recording (W~'s shape, opts, prepared) of every call."""
  calls = []
  real = sparse_ops.sparse_linear

  def spy(x, w, key=None, opts=sparse_ops.GemmOptions(), prepared=None):
    calls.append((tuple(w.shape), opts, prepared))
    return real(x, w, key, opts, prepared)

  monkeypatch.setattr(sparse_ops, "sparse_linear", spy)
  return calls


def test_the_tied_head_gets_the_same_gemm_options_as_the_other_layers(monkeypatch):
  c = _tiny("t_sr_ste", {"sparsity.mvue": True, "sparsity.sparse_layers": ("*/mlp/*", "wte")})
  model_cfg = RunSpec.build(c).model_cfg
  model = GPT2(model_cfg)
  tokens = jnp.zeros((4, 16), jnp.int32)
  variables = model.init(jax.random.PRNGKey(0), tokens)
  assert state_lib.HEAD in variables["sparsity"]                 # the head is sparse
  calls = _recording_sparse_linear(monkeypatch)
  model.apply(variables, tokens, rngs={"mvue": jax.random.PRNGKey(1)})
  C, H, V = c.model.d_model, model_cfg.mlp_hidden, c.model.vocab_size
  assert sorted(shape for shape, _, _ in calls) == sorted([(H, C), (C, H), (V, C)])
  want = model_cfg.sparsity.gemm
  assert want.transposable and want.mvue and want.backend == "xla"
  for shape, opts, _ in calls:
    assert opts == want, shape


# ---------------------------------------------------------------------------------------------
# prepare: the 'prepared' collection, apart from 'sparsity'.


def _fresh(config):
  spec = RunSpec.build(config)
  model = GPT2(spec.model_cfg)
  state = train.fresh_state(model, spec.tx, config.seed)
  return spec, model, state


def test_prepare_is_empty_for_a_backend_that_prepares_nothing():
  for backend in ("xla", "pallas"):
    spec, _, state = _fresh(_tiny("t_sr_ste", {"sparsity.backend": backend}))
    assert sparse_ops.get_backend(backend).prepare is None
    assert sparse_linear.prepare(spec.model_cfg, state.params, state.sparsity, tokens=64,
                                 dtype=jnp.float32) == {}
  # A dense model prepares nothing either, whatever the backend.
  spec, _, state = _fresh(_tiny("dense", {"sparsity.backend": "cusparselt"}))
  assert sparse_linear.prepare(spec.model_cfg, state.params, state.sparsity, tokens=64,
                               dtype=jnp.float32) == {}


@pytest.mark.parametrize("fp8", [False, True])
def test_cusparselt_prepare_returns_a_separate_tree(fp8, monkeypatch):
  """With 'cusparselt' (stand-in) and the tied head sparse too: one entry per sparse FFN layer
  (not the head), holding W~ compressed (the stand-in's buffer: W~'s bytes, FP8: e4m3 with
  W~'s amax scale); the 'sparsity' collection keeps only the method's state, before and after
  a train step; the FFN layers receive their entry, the head none."""
  c = _tiny("t_sr_ste", {"sparsity.backend": "cusparselt", "sparsity.fp8": fp8,
                         "sparsity.sparse_layers": ("*/mlp/*", "wte"),
                         "sparsity.gemm_choice": "sparse",   # every GEMM it can on cuSPARSELt
                         "model.dtype": "bfloat16"})
  with cusparselt.standin():   # the sparse head's init (see the test below)
    spec, model, state = _fresh(c)
  method = spec.model_cfg.sparsity.method
  paths = state_lib.sparse_layer_paths(state.sparsity)
  assert (state_lib.HEAD,) in paths
  method_keys = {p: set(state_lib.get_path(state.sparsity, p)) for p in paths}
  assert all(keys == {"mask", "plain_mask"} for keys in method_keys.values()), method_keys
  tokens = c.batch_size * c.model.seq_len
  with cusparselt.standin():
    prepared = jax.jit(lambda p, s: sparse_linear.prepare(
        spec.model_cfg, p, s, tokens=tokens, dtype=jnp.bfloat16))(state.params, state.sparsity)
  flat = flax.traverse_util.flatten_dict(prepared)
  layers = sorted({k[:-1] for k in flat})
  assert layers == sorted(p for p in paths if p != (state_lib.HEAD,))
  assert layers == [("h_0", "mlp", "fc"), ("h_0", "mlp", "proj")]
  want_keys = {"fwd", "fwd_scale", "dx", "dx_scale"} if fp8 else {"fwd", "dx"}
  for path in layers:
    entry = state_lib.get_path(prepared, path)
    assert set(entry) == want_keys, (path, set(entry))
    kernel = np.asarray(state_lib.get_path(state.params, path)["kernel"])
    mask = np.asarray(state_lib.get_path(state.sparsity, path)["mask"])
    wt = np.where(mask, kernel, 0).astype(np.float32)            # W~ = m (.) W
    np.testing.assert_array_equal(
        np.asarray(method.project(jnp.asarray(kernel),
                                  state_lib.get_path(state.sparsity, path))), wt)
    n, k = wt.shape
    # The forward's operand is W~ (TN); the data gradient's W~ itself (NN, bf16, where the
    # library compresses) or W~^T (TN: FP8, the only layout 8-bit types take, or where s24jax
    # compresses), in the backward's format (e5m2).
    for name, fmt in (("fwd", ml_dtypes.float8_e4m3fn), ("dx", ml_dtypes.float8_e5m2)):
      buf = entry[name]
      dtype = fmt if fp8 else jnp.bfloat16
      with cusparselt.standin():
        gemm = (cslt_gemms.fwd_gemm(tokens, n, k) if name == "fwd"
                else cslt_gemms.dgrad_gemm(tokens, n, k,
                                           cslt_gemms.dgrad_tn(tokens, n, k, dtype)))
      assert buf.dtype == jnp.uint8 and buf.shape == (gemm.compressed_bytes(dtype),)
      got = np.asarray(cusparselt._standin_decompress(buf, gemm, dtype), np.float32)  # pylint: disable=protected-access
      op_a = wt if name == "fwd" else wt.T                     # op(A): (m, k)
      a16 = op_a.astype(ml_dtypes.bfloat16).astype(np.float32)
      if not fp8:
        np.testing.assert_array_equal(got, a16, err_msg=name)
        continue
      # The scale fmax / amax: XLA's GPU backend divides with PTX div.full (at most 2 ulp,
      # XLA's -nvptx-prec-divf32=1), not IEEE division as NumPy and the CPU do: rtol 1e-6
      # (8 ulp). The values: W~ quantized (round to nearest even) with the scale the step
      # used, or one within those 2 ulp (XLA may compute the scale again inside the fusion
      # that quantizes), from W~ in bfloat16 as written, or in float32: XLA's GPU backend
      # may skip the bf16 rounding inside a fusion (its xla_allow_excess_precision, on by
      # default). Seen on an H200 (2026-11-27): 35 of 4096 values of the forward's W~ were
      # the float32 W~'s quantization, one FP8 ulp from the bf16 W~'s. Anything else (a
      # wrong scale, operand, layout or format) misses every admissible value by far.
      scale = np.float32(float(ml_dtypes.finfo(fmt).max) / np.abs(a16).max())
      used = np.float32(entry[f"{name}_scale"])
      np.testing.assert_allclose(used, scale, rtol=1e-6)
      scales = [used]
      for direction in (0.0, np.inf):
        s = used
        for _ in range(2):
          s = np.nextafter(s, np.float32(direction))
          scales.append(s)
      admissible = np.stack([(a * s).astype(fmt).astype(np.float32)
                             for a in (a16, op_a) for s in scales])
      ok = np.any(got[None] == admissible, axis=0)
      assert ok.all(), (f"{name}: {np.sum(~ok)} of {ok.size} values are not W~ (bf16 or "
                        f"float32) quantized with a scale within 2 ulp of {used!r}; first: "
                        f"got {got[~ok][:4]}, want {admissible[0][~ok][:4]}")

  # The model receives them as variables['prepared']: the FFN layers their entry, the head
  # none; and a train step leaves 'sparsity' with the method's state only.
  calls = _recording_sparse_linear(monkeypatch)
  batch = {"inputs": jnp.zeros((c.batch_size, c.model.seq_len), jnp.int32),
           "targets": jnp.zeros((c.batch_size, c.model.seq_len), jnp.int32)}
  with cusparselt.standin():
    model.apply({"params": state.params, "sparsity": state.sparsity,
                 sparse_linear.PREPARED: prepared}, batch["inputs"])
    head = [p for shape, _, p in calls if shape == (c.model.vocab_size, c.model.d_model)]
    ffn = [p for shape, _, p in calls if shape != (c.model.vocab_size, c.model.d_model)]
    assert head == [None] and len(ffn) == 2
    assert all(set(p) == want_keys for p in ffn)
    new_state, _ = train.train_step(state, batch, model=model,
                                    tx=spec.tx(state.params, state.sparsity))
  for p in paths:
    assert set(state_lib.get_path(new_state.sparsity, p)) == method_keys[p], p
  assert sparse_linear.PREPARED not in new_state.sparsity


@pytest.mark.parametrize("backend", ["cusparselt", "tcgen05"])
def test_init_runs_no_kernel_for_the_sparse_head_either(backend):
  """Building a run (its state's shapes: RunSpec.build, init) needs no kernel, as for the FFN
  layers (SparseLinear initializes with the 'xla' reference): so it works off a GPU with a
  GPU-only backend, the tied head sparse too."""
  for layers in (("*/mlp/*",), ("*/mlp/*", "wte")):
    c = _tiny("t_sr_ste", {"sparsity.backend": backend, "sparsity.sparse_layers": layers,
                           "model.dtype": "bfloat16"})   # cusparselt refuses float32 (R7)
    spec = RunSpec.build(c)
    variables = GPT2(spec.model_cfg).init(jax.random.PRNGKey(0),
                                          jnp.zeros((1, 16), jnp.int32))
    assert ((state_lib.HEAD in variables["sparsity"]) == ("wte" in layers)), layers
