"""Tests for s24jax/methods/mst/attention_masks.py and the model's attention-pattern hook (MST Hybrid
Sparse Attention): every mask against a double loop written from the definition, pair counts
computed by hand, and the model's attention layer against plain NumPy attention (float64)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.methods.mst import attention_masks
from s24jax.nn.model import CausalSelfAttention
from s24jax.nn.model import ModelConfig

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")


def _mask_loops(pattern: str, T: int, l: int) -> np.ndarray:
  """The definitions, one (q, k) pair at a time."""
  out = np.zeros((T, T), bool)
  for q in range(T):
    for k in range(T):
      if pattern == "causal":
        out[q, k] = q >= k
      elif pattern == "strided":
        out[q, k] = q >= k and (q - k) % l == 0
      else:   # local_strided: the last l tokens (window l) or the stride
        out[q, k] = q >= k and ((q - k) < l or (q - k) % l == 0)
  return out


@pytest.mark.parametrize("pattern", attention_masks.PATTERNS)
@pytest.mark.parametrize("T,l", [(1, 1), (7, 1), (16, 4), (13, 5), (10, 16), (64, 8)])
def test_masks_match_double_loop(pattern, T, l):
  want = _mask_loops(pattern, T, l)
  got = np.asarray(attention_masks.attention_mask(pattern, T, l))
  assert got.dtype == bool and got.shape == (T, T)
  np.testing.assert_array_equal(got, want)
  assert got.diagonal().all()                      # no query row is ever empty
  assert attention_masks.allowed_pairs(pattern, T, l) == want.sum()


def test_pair_counts_hand_computed():
  assert attention_masks.allowed_pairs("causal", 1024, 128) == 1024 * 1025 // 2
  # T=8, l=4: strided keeps q-k in {0, 4}: 8 + 4 pairs; local_strided adds q-k in {1, 2, 3}.
  assert attention_masks.allowed_pairs("strided", 8, 4) == 12
  assert attention_masks.allowed_pairs("local_strided", 8, 4) == 12 + 7 + 6 + 5
  assert attention_masks.allowed_pairs("strided", 8, 1) == 36   # stride 1 is dense causal


def test_bad_pattern_and_stride():
  with pytest.raises(ValueError, match="valid: causal, strided, local_strided"):
    attention_masks.attention_mask("sliding", 8, 4)
  with pytest.raises(ValueError, match="stride >= 1"):
    attention_masks.attention_mask("strided", 8, 0)
  with pytest.raises(ValueError, match="unknown attention pattern 'dense'"):
    ModelConfig(attention="dense")


def _attention_np(x, w_qkv, b_qkv, w_out, b_out, nh, allowed):
  """Plain NumPy multi-head attention with a boolean mask (float64)."""
  T, C = x.shape
  hd = C // nh
  qkv = x @ w_qkv.T + b_qkv                                                # (T, 3C)
  q, k, v = (qkv[:, i * C:(i + 1) * C].reshape(T, nh, hd) for i in range(3))
  s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)                        # (nh, T, T)
  s = np.where(allowed[None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  y = np.einsum("hqk,khd->qhd", p, v).reshape(T, C)                        # (T, C)
  return y @ w_out.T + b_out


@pytest.mark.parametrize("pattern", attention_masks.PATTERNS)
def test_model_attention_uses_the_pattern(pattern):
  T, C, nh, l = 12, 16, 2, 3
  # float32 XLA attention everywhere (the defaults 'auto' pick bfloat16 and cuDNN on a GPU).
  cfg = ModelConfig(vocab_size=64, seq_len=T, num_layers=1, num_heads=nh, d_model=C,
                    attention=pattern, attention_stride=l, dtype="float32",
                    attention_impl="xla")
  layer = CausalSelfAttention(cfg)
  x = jax.random.normal(jax.random.PRNGKey(0), (1, T, C))
  params = layer.init(jax.random.PRNGKey(1), x)
  # Larger random biases and kernels so every score matters.
  params = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(p.size), p.shape) * 0.5,
                        params)
  y = layer.apply(params, x)[0]                                             # (T, C)
  allowed = _mask_loops(pattern, T, l)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
  want = _attention_np(np.asarray(x[0], np.float64), p["qkv"]["kernel"], p["qkv"]["bias"],
                       p["out"]["kernel"], p["out"]["bias"], nh, allowed)
  np.testing.assert_allclose(np.asarray(y), want, rtol=2e-4, atol=2e-4)
  # Output q depends on input k exactly where the pattern allows the pair.
  jac = jax.jacobian(lambda x_: layer.apply(params, x_[None])[0])(x[0])      # (T, C, T, C)
  depends = np.abs(np.asarray(jac)).sum(axis=(1, 3)) > 0
  np.testing.assert_array_equal(depends, allowed)


def test_causal_mask_path_equals_is_causal():
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 9, 2, 4)) for i in range(3))
  mask = attention_masks.attention_mask("causal", 9, 1)
  a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  b = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  assert dataclasses.replace(ModelConfig(), attention="strided").attention == "strided"
