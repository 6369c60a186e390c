"""Tests of s24jax/nn/llama.py, the Llama-style family (`model.family='llama'`).

References: rotary embeddings against transformers' formula written in NumPy (inv_freq =
base^(-2i/d), rotate_half pairing the two halves); grouped-query attention against the same
attention with each key/value head repeated for its query heads (multi-head attention); the
FFN hidden size against Llama's published sizes; the module tree against the names the export
maps; every built-in recipe's `llama_*.py` file training a few steps. The logits against
transformers' LlamaForCausalLM: tests/cli/test_export.py.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.training import config as config_lib
from s24jax import config_files
from s24jax.training import flops
from s24jax.nn import llama
from s24jax.nn import model as model_lib
from s24jax.training import train
from s24jax.training.run_spec import RunSpec

import os
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(**kw):
  c = config_lib.apply_variant(config_lib.base_config("llama"), "small")
  base = model_lib.model_config(c)
  args = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, vocab_size=96,
              seq_len=16, dtype="float32", attention_impl="xla")
  args.update(kw)
  return dataclasses.replace(base, **args)


def test_rotary_is_transformers_half_split_convention():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)       # (B, T, heads, hd)
  base = 500.0
  inv = 1.0 / base ** (np.arange(0, 8, 2) / 8)                    # (hd/2,)
  ang = np.arange(5)[:, None] * inv[None]                         # (T, hd/2)
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
  half = np.concatenate([-x[..., 4:], x[..., :4]], -1)
  want = x * cos[None, :, None] + half * sin[None, :, None]
  np.testing.assert_allclose(llama.rotary(jnp.asarray(x), base), want, rtol=1e-5, atol=1e-6)
  # position 0 is the identity; the rotation keeps each pair's norm
  np.testing.assert_allclose(llama.rotary(jnp.asarray(x), base)[:, 0], x[:, 0], atol=1e-7)


def test_grouped_query_attention_equals_repeated_key_value_heads():
  """num_kv_heads=2 for 4 query heads equals multi-head attention whose k / v weights repeat
  each key/value head for its 2 query heads."""
  gqa = _cfg(num_kv_heads=2)
  mha = dataclasses.replace(gqa, num_kv_heads=0)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 16)), jnp.int32)
  v_gqa = model_lib.build(gqa).init(jax.random.key(0), tokens)
  params = jax.tree.map(lambda a: a, v_gqa["params"])
  hd = 64 // 4
  for i in range(2):
    for name in ("k", "v"):
      kernel = params[f"h_{i}"]["attn"][name]["kernel"]             # (kv * hd, C)
      heads = kernel.reshape(2, hd, 64)
      params[f"h_{i}"]["attn"][name] = {"kernel": jnp.repeat(heads, 2, axis=0).reshape(4 * hd, 64)}
  got = model_lib.build(gqa).apply(v_gqa, tokens)
  want = model_lib.build(mha).apply({"params": params}, tokens)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ffn_hidden_size_is_llamas_rule():
  c = config_lib.base_config("llama")
  base = model_lib.model_config(c)
  assert dataclasses.replace(base, d_model=4096, num_heads=32, num_kv_heads=8).mlp_hidden == 11008  # 7B
  assert dataclasses.replace(base, d_model=2048, num_heads=32, num_kv_heads=4).mlp_hidden == 5632   # 1.1B
  assert model_lib.model_config(c).mlp_hidden == 2048                                       # 125m
  assert _cfg(activation="swiglu", d_model=128, ffn_multiple_of=32).mlp_hidden == 352


def test_module_names_biases_and_untied_head():
  cfg = _cfg()
  params = model_lib.build(cfg).init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
  assert set(params) == {"embed", "h_0", "h_1", "norm", "lm_head"}
  block = params["h_0"]
  assert set(block) == {"attn", "mlp", "attn_norm", "mlp_norm"}
  assert set(block["attn"]) == {"q", "k", "v", "o"} and set(block["mlp"]) == {"gate", "up", "down"}
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  assert not [p for p, _ in leaves if "bias" in jax.tree_util.keystr(p)]          # no biases
  assert params["lm_head"]["kernel"].shape == params["embed"]["embedding"].shape   # untied
  assert block["attn"]["k"]["kernel"].shape == (2 * 16, 64)                        # 2 kv heads


def test_bad_family_settings_name_the_field():
  with pytest.raises(ValueError, match="num_kv_heads"):
    _cfg(num_kv_heads=3)
  with pytest.raises(ValueError, match="unknown model.family 'gpt3'; valid: gpt2, llama"):
    _cfg(family="gpt3")
  with pytest.raises(ValueError, match=r"valid: tiny, small, 125m, 1b, 7b"):
    config_lib.apply_variant(config_lib.base_config("llama"), "124m")


def test_small_ffn_is_most_of_the_training_flops_and_the_head_counted_once():
  spec = RunSpec.build(config_files.load_config(os.path.join(REPO, "experiments",
                                                             "llama_dense.py") + ":small"))
  c = spec.config
  tokens = c.batch_size * c.model.seq_len
  step = flops.step_flops(spec.model_cfg, spec.kernel_shapes, {}, batch_size=c.batch_size,
                          seq_len=c.model.seq_len, attention="causal")
  ffn = sum(6 * o * i * tokens for k, (o, i) in spec.kernel_shapes.items() if "/mlp/" in k)
  assert ffn / step.total > 0.5
  # The untied head is the head term (V x C), not also a linear layer.
  assert step.head == 6 * c.model.vocab_size * c.model.d_model * tokens
  linear = sum(6 * o * i * tokens for k, (o, i) in spec.kernel_shapes.items() if k != "lm_head")
  assert step.linear == linear


def test_scanned_remat_chunked_llama_equals_the_plain_model():
  cfg = _cfg(activation="swiglu")
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 96, (2, 16)), jnp.int32)
  plain = model_lib.build(cfg)
  v = plain.init(jax.random.key(0), tokens)
  want = plain.apply(v, tokens, tokens)
  other = dataclasses.replace(cfg, scan_layers=True, remat="save_dots", loss_chunk=8)
  stacked = {"params": {**{k: v["params"][k] for k in ("embed", "norm", "lm_head")},
                        "h": jax.tree.map(lambda a, b: jnp.stack([a, b]), v["params"]["h_0"],
                                          v["params"]["h_1"])}}
  got = model_lib.build(other).apply(stacked, tokens, tokens)
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("recipe", ["dense", "ste", "sr_ste", "t_sr_ste_df", "s_ste",
                                    "relu2_dense", "venom", "mst"])
def test_every_recipe_trains_on_the_llama_family(recipe):
  """Each llama_*.py recipe (its small variant, shortened to one layer) takes 4 jitted
  steps: finite, falling loss; its sparse layers are the family's FFN matrices (MST: every
  linear layer and the untied head)."""
  c = config_files.load_config(os.path.join(REPO, "experiments", f"llama_{recipe}.py") + ":small",
                               args=["batch_size=4", "model.seq_len=32", "model.num_layers=1",
                                     "total_steps=8"])
  spec = RunSpec.build(c)
  assert spec.model_cfg.family == "llama"
  sparse = set(spec.sparse_shapes)
  if recipe in ("dense", "relu2_dense"):
    assert not sparse
  elif recipe == "mst":
    assert "lm_head" in sparse and "h_0/attn/q" in sparse and "h_0/mlp/gate" in sparse
  else:
    ffn = {"up", "down"} | ({"gate"} if recipe != "venom" else set())
    assert sparse == {f"h_0/mlp/{m}" for m in ffn}, sparse
  model = model_lib.build(spec.model_cfg)
  state = jax.jit(lambda: spec.fresh_state(0))()
  tx = spec.tx(state.params, state.sparsity)
  rng, losses = np.random.default_rng(0), []
  for _ in range(4):
    tok = jnp.asarray(rng.integers(0, 256, (4, 32)), jnp.int32)
    state, m = train.train_step(state, {"inputs": tok, "targets": tok}, model=model, tx=tx)
    losses.append(float(m["loss"] / m["count"]))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
