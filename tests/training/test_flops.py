"""Tests for s24jax/training/flops.py: a dense step against the analytic 6 N tokens + attention, the
sparse parts against counts written out by hand (attention pairs by a double loop), and the
planned run totals of a RunSpec against the same sums written out."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tiny import tiny_config

from s24jax.training import flops
from s24jax import state as state_lib
from s24jax.methods.mst import densities
from s24jax.training.run_spec import RunSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DENSE = os.path.join(REPO, "experiments", "gpt2_dense.py")


def _config(activation="gelu", **mst_overrides):
  c = tiny_config("mst", steps=40)
  c.sparsity.sparse_layers = ("*/attn/*", "*/mlp/*")
  c.model.num_layers, c.model.num_heads, c.model.d_model = 2, 2, 32
  c.model.activation = activation
  c.model.attention_stride = 4
  for k, v in mst_overrides.items():
    c.sparsity.mst[k] = v
  return c


def _shapes(config):
  """(model config, (out, in) of every linear kernel, the sparse layers' weight shapes)."""
  spec = RunSpec.build(config)
  return spec.model_cfg, spec.kernel_shapes, spec.sparse_shapes


def _pairs_loop(pattern, T, l):
  n = 0
  for q in range(T):
    for k in range(q + 1):
      d = q - k
      n += (pattern == "causal" or d % l == 0 or (pattern == "local_strided" and d < l))
  return n


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_dense_step_is_6n_tokens_plus_attention(activation):
  config = _config(activation)
  model_cfg, shapes, masked = _shapes(config)
  L, C, V, T, B = 2, 32, config.model.vocab_size, config.model.seq_len, config.batch_size
  H = 4 * C
  fc_out = 2 * H if activation == "swiglu" else H
  n = L * (3 * C * C + C * C + fc_out * C + C * H) + V * C   # matmul weights incl. the head
  attention = 12 * L * C * B * T * (T + 1) // 2              # causal: T(T+1)/2 pairs
  got = flops.step_flops(model_cfg, shapes, {}, batch_size=B, seq_len=T, attention="causal")
  assert got.total == 6 * n * B * T + attention
  assert got.head == 6 * V * C * B * T and got.update == 0
  assert sorted(masked) == sorted(shapes) and len(shapes) == 4 * L


@pytest.mark.parametrize("pattern", ["strided", "local_strided"])
def test_sparse_masks_and_attention(pattern):
  config = _config()
  model_cfg, shapes, _ = _shapes(config)
  B, T = 3, config.model.seq_len
  nnz = {"h_0/mlp/fc": 100, "h_1/attn/qkv": 7}
  got = flops.step_flops(model_cfg, shapes, nnz, batch_size=B, seq_len=T, attention=pattern)
  active = sum(nnz.get(k, o * i) for k, (o, i) in shapes.items())
  assert got.linear == 6 * active * B * T
  assert got.attention == 12 * 2 * 32 * B * _pairs_loop(pattern, T, 4)
  with pytest.raises(ValueError, match="unknown linear layers"):
    flops.step_flops(model_cfg, shapes, {"h_9/mlp/fc": 1}, batch_size=B, seq_len=T,
                     attention=pattern)


def test_dense_weight_gradient_step():
  """An MST update step: 4 nnz + 2 out*in per token instead of 6 nnz (the dense weight
  gradient), no extra pass; a sparse tied head ('wte' in nnz) likewise."""
  config = _config()
  model_cfg, shapes, _ = _shapes(config)
  B, T, V, C = 2, config.model.seq_len, config.model.vocab_size, 32
  nnz = {k: (o * i) // 5 for k, (o, i) in shapes.items()}
  plain = flops.step_flops(model_cfg, shapes, nnz, batch_size=B, seq_len=T, attention="causal")
  upd = flops.step_flops(model_cfg, shapes, nnz, batch_size=B, seq_len=T, attention="causal",
                         dense_weight_gradient=True)
  size = sum(o * i for o, i in shapes.values())
  assert upd.linear == (4 * sum(nnz.values()) + 2 * size) * B * T
  assert upd.attention == plain.attention and upd.head == plain.head == 6 * V * C * B * T
  assert upd.update == upd.total - plain.total == 2 * (size - sum(nnz.values())) * B * T
  head = {**nnz, "wte": V * C // 10}
  sparse_head = flops.step_flops(model_cfg, shapes, head, batch_size=B, seq_len=T,
                                 attention="causal", dense_weight_gradient=True)
  assert sparse_head.head == (4 * (V * C // 10) + 2 * V * C) * B * T


def test_planned_dense_run():
  config = _config()
  config.sparsity.method = "dense"
  acct = flops.planned(RunSpec.build(config))
  model_cfg, shapes, _ = _shapes(config)
  one = flops.step_flops(model_cfg, shapes, {}, batch_size=config.batch_size,
                         seq_len=config.model.seq_len, attention="causal")
  assert acct.steps == 40
  assert acct.total.total == pytest.approx(40 * one.total, rel=1e-12)
  assert acct.dense_total.total == acct.total.total
  assert flops.summary(acct)["flops_reduction"] == pytest.approx(1.0)


def test_planned_mst_run_constant_sparsity():
  """Every level at 75%: the random start prunes int(S_l N_l) per layer and every update keeps
  the counts; updates at steps 4, 8, ..., 36 (9: never at 0) compute the dense weight
  gradient; strided attention during steps [10, 30); the head is dense here."""
  s = 0.75
  config = _config(target_sparsity=s, ultra_sparsity=s, final_sparsity=s,
                   update_every=4, sparse_attention="strided", sparse_attention_start=0.25,
                   sparse_attention_end=0.75)
  model_cfg, shapes, masked = _shapes(config)
  sizes = {k: o * i for k, (o, i) in masked.items()}
  er = densities.layer_sparsities({k: masked[k] for k in densities.reference_order(masked)},
                                 s)
  counts = {k: n - int(er[k] * n) for k, n in sizes.items()}
  B, T, L, C = config.batch_size, config.model.seq_len, 2, 32
  size = sum(o * i for o, i in shapes.values())
  k = sum(counts.values())
  assert abs(k - 0.25 * size) <= len(shapes)
  tokens = B * T
  head = 6 * config.model.vocab_size * C * tokens
  causal, strided = (12 * L * C * B * _pairs_loop(p, T, 4) for p in ("causal", "strided"))
  updates = 9
  want = (40 * (6 * k * tokens + head) + 20 * causal + 20 * strided
          + updates * 2 * (size - k) * tokens)
  acct = flops.planned(RunSpec.build(config))
  assert acct.nnz == counts
  assert acct.total.total == pytest.approx(want, rel=1e-12)
  assert acct.total.update == pytest.approx(updates * 2 * (size - k) * tokens, rel=1e-12)
  dense = 40 * (6 * size * tokens + head + causal)
  assert acct.dense_total.total == pytest.approx(dense, rel=1e-12)
  half = flops.planned(RunSpec.build(config), upto=20)
  assert half.steps == 20 and half.total.total < acct.total.total
  summ = flops.summary(acct)
  assert summ["flops_reduction"] == pytest.approx(dense / want)
  assert summ["flops_reduction_no_head"] == pytest.approx(
      (dense - 40 * head) / (want - 40 * head))


def test_planned_mst_run_with_the_sparse_head():
  """With 'wte' in the sparse layers the head costs 6 nnz_head per token (its ER density is
  the lowest of all layers) and the reduction counts it."""
  config = _config(update_every=4)
  config.sparsity.sparse_layers = ("*/attn/*", "*/mlp/*", "wte")
  model_cfg, shapes, masked = _shapes(config)
  acct = flops.planned(RunSpec.build(config))
  V, C, tokens = config.model.vocab_size, 32, config.batch_size * config.model.seq_len
  assert masked["wte"] == (V, C) and "wte" in acct.nnz
  assert acct.nnz["wte"] / (V * C) == min(n / (masked[k][0] * masked[k][1])
                                          for k, n in acct.nnz.items())
  assert acct.last.head == 6 * acct.nnz["wte"] * tokens
  dense_head = flops.planned(RunSpec.build(_config(update_every=4)))
  assert flops.summary(acct)["flops_reduction"] > 3 * flops.summary(dense_head)[
      "flops_reduction"]
  del model_cfg


def test_accountant_scalars():
  config = _config()
  model_cfg, shapes, _ = _shapes(config)
  acct = flops.Accountant(model_cfg, shapes, batch_size=2, seq_len=config.model.seq_len)
  acct.add({}, "causal")
  acct.add({k: 0 for k in shapes}, "strided")
  sc = acct.scalars()
  assert sc["flops/dense_total"] == 2 * acct._step({}, "causal", False).total  # pylint: disable=protected-access
  assert sc["flops/total"] == sc["flops/dense_total"] / 2 + sc["flops/step"]
  assert 0.5 < sc["flops/fraction_of_dense"] < 1.0
  assert np.isfinite(sc["flops/step"])


def test_small_variant_ffn_is_most_of_the_training_flops():
  """The test bed's point (issue 20): the 2:4 FFN layers are >= half of a step's FLOPs."""
  from s24jax import config_files   # pylint: disable=g-import-not-at-top
  config = config_files.load_config(f"{DENSE}:small")
  spec = RunSpec.build(config)
  model_cfg, shapes = spec.model_cfg, state_lib.linear_kernel_shapes(spec.abstract_state.params)
  C, L = config.model.d_model, config.model.num_layers
  assert shapes == {f"h_{l}/{k}": v for l in range(L) for k, v in {
      "attn/qkv": (3 * C, C), "attn/out": (C, C), "mlp/fc": (4 * C, C),
      "mlp/proj": (C, 4 * C)}.items()}                 # (out, in), written out
  step = flops.step_flops(model_cfg, shapes, {}, batch_size=config.batch_size,
                          seq_len=config.model.seq_len, attention="causal")
  ffn = sum(6.0 * o * i * config.batch_size * config.model.seq_len
            for k, (o, i) in shapes.items() if "/mlp/" in k)
  assert ffn / step.total > 0.55
  tiny = config_files.load_config(f"{DENSE}:tiny")
  assert step.head / step.total < 0.06 and tiny.model.vocab_size > 100 * config.model.vocab_size
