"""Tests for s24jax/nn/layers.py's choices that depend on the platform: the compute dtype 'auto'
(tests/nn/test_model.py) and the attention implementation 'auto', here. The reference is what
cuDNN's flash attention takes, as jax checks it (16-bit q/k/v, a head dim that is a multiple
of 8 and at most 128 on every GPU): each case below is one side of one of those conditions."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest

from s24jax.nn import layers
from s24jax.kernels import _common
from s24jax.nn.model import ModelConfig


@pytest.mark.parametrize("attention,dtype,head_dim,platform,want", [
    ("causal", jnp.bfloat16, 64, "gpu", "cudnn"),
    ("causal", jnp.float16, 128, "gpu", "cudnn"),
    ("causal", jnp.float32, 64, "gpu", "xla"),      # cuDNN takes 16-bit inputs only
    ("causal", jnp.bfloat16, 15, "gpu", "xla"),     # not a multiple of 8
    ("causal", jnp.bfloat16, 136, "gpu", "xla"),    # above 128
    ("strided", jnp.bfloat16, 64, "gpu", "xla"),    # MST's masks: XLA's attention
    ("causal", jnp.bfloat16, 64, "cpu", "xla"),
])
def test_auto_attention_is_cudnn_only_where_cudnn_takes_it(monkeypatch, attention, dtype,
                                                          head_dim, platform, want):
  monkeypatch.setattr(_common, "target_device", lambda: types.SimpleNamespace(platform=platform))
  cfg = ModelConfig(attention=attention)
  q = jax.ShapeDtypeStruct((2, 16, 4, head_dim), dtype)        # (B, T, N, hd)
  assert layers.attention_implementation(cfg, q) == want


def test_an_explicit_attention_implementation_is_kept(monkeypatch):
  monkeypatch.setattr(_common, "target_device", lambda: types.SimpleNamespace(platform="cpu"))
  q = jax.ShapeDtypeStruct((2, 16, 4, 15), jnp.float32)
  assert layers.attention_implementation(ModelConfig(attention_impl="cudnn"), q) == "cudnn"
  assert layers.attention_implementation(ModelConfig(attention_impl="xla"), q) == "xla"


def test_a_step_put_on_the_cpu_of_a_gpu_host_runs_xla_attention(monkeypatch):
  """The target device decides, not jax's default backend: on a GPU host (jax's first device a
  GPU, as the patch says), a step built under jax.default_device(cpu) cannot run cuDNN."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q = jax.ShapeDtypeStruct((2, 16, 4, 64), jnp.bfloat16)
  with jax.default_device(jax.devices("cpu")[0]):
    assert layers.attention_implementation(ModelConfig(), q) == "xla"
