"""GPT-2 in flax.linen: pre-LN blocks, learned positions, tied embeddings.

All linear layers are `SparseLinear`; the FFN's are 2:4 sparse by default
(`SparsityConfig.sparse_layers`). Parameters are float32; `ModelConfig.dtype` is the
compute dtype.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from s24jax import act_sparsity
from s24jax import activations
from s24jax import attention_masks
from s24jax.config import ModelConfig
from s24jax.sparse_linear import SparseLinear


def compute_dtype(name: str) -> jnp.dtype:
  """'auto' is bfloat16 on accelerators and float32 on CPU (no fast bf16 matmul there)."""
  if name == "auto":
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  return jnp.dtype(name)


class CausalSelfAttention(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    dtype = compute_dtype(cfg.dtype)
    B, T, C = x.shape
    nh = cfg.num_heads
    hd = C // nh
    qkv = SparseLinear(3 * C, cfg.sparsity, dtype=dtype, name="qkv")(x)       # (B, T, 3C)
    q, k, v = jnp.split(qkv.reshape(B, T, 3, nh, hd), 3, axis=2)             # (B, T, 1, nh, hd)
    q, k, v = (a.squeeze(2) for a in (q, k, v))                               # (B, T, nh, hd)
    if cfg.attention == "causal":
      y = jax.nn.dot_product_attention(q, k, v, is_causal=True)              # (B, T, nh, hd)
    else:   # Hybrid Sparse Attention (MST): the pattern already includes causality
      mask = attention_masks.attention_mask(cfg.attention, T, cfg.attention_stride)  # (T, T)
      y = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])       # (B, T, nh, hd)
    out_init = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
    return SparseLinear(C, cfg.sparsity, dtype=dtype, kernel_init=out_init,
                        name="out")(y.reshape(B, T, C))                       # (B, T, C)


class MLP(nn.Module):
  """FFN: fc -> activation -> proj. Gated activations make fc produce value and gate halves."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    dtype = compute_dtype(cfg.dtype)
    C = x.shape[-1]
    H = cfg.mlp_hidden
    gated = cfg.activation in activations.GATED
    h = SparseLinear((2 if gated else 1) * H, cfg.sparsity, dtype=dtype, name="fc")(x)  # (B, T, H|2H)
    h = activations.apply(cfg.activation, h)                                  # (B, T, H)
    sp = cfg.sparsity
    mask, matmul = None, None
    if sp.act_sparsity == "venom":   # Haziza et al.: V:N:M activations into the 2nd matmul
      h_sparse, mask, meta = act_sparsity.sparsify(h, sp.act_v, sp.act_n, sp.act_m,
                                                   backend=sp.act_backend)
      matmul = act_sparsity.act_matmul(meta, sp.act_v, sp.act_backend)
    if self.is_mutable_collection("intermediates") and not self.is_initializing():
      # Only in act_sparsity.activation_stats' forward pass; train/eval steps skip this.
      stats = act_sparsity.activation_sparsity_stats(h, sp.act_v, sp.act_n, sp.act_m, mask)
      for name, value in stats.items():
        self.sow("intermediates", f"act_{name}", value)
    if mask is not None:
      h = h_sparse                                                            # (B, T, H)
    out_init = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
    return SparseLinear(C, cfg.sparsity, dtype=dtype, kernel_init=out_init, name="proj",
                        matmul=matmul)(h)


class Block(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = compute_dtype(self.config.dtype)
    x = x + CausalSelfAttention(self.config, name="attn")(nn.LayerNorm(dtype=dtype, name="ln_1")(x))
    x = x + MLP(self.config, name="mlp")(nn.LayerNorm(dtype=dtype, name="ln_2")(x))
    return x                                                                  # (B, T, C)


class GPT2(nn.Module):
  """Token ids (B, T) -> logits (B, T, vocab) in float32."""
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    dtype = compute_dtype(cfg.dtype)
    B, T = tokens.shape
    if T > cfg.seq_len:
      raise ValueError(f"sequence length {T} exceeds model.seq_len={cfg.seq_len}")
    wte = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(0.02),
                   dtype=dtype, name="wte")
    wpe = self.param("wpe", nn.initializers.normal(0.01), (cfg.seq_len, cfg.d_model))
    x = (wte(tokens) + wpe[:T]).astype(dtype)                                 # (B, T, C)
    for i in range(cfg.num_layers):
      x = Block(cfg, name=f"h_{i}")(x)
    x = nn.LayerNorm(dtype=dtype, name="ln_f")(x)
    logits = wte.attend(x.astype(dtype))                                      # (B, T, V)
    return logits.astype(jnp.float32)


def num_params(params, *, exclude_embeddings: bool = False) -> int:
  n = sum(p.size for p in jax.tree.leaves(params))
  if exclude_embeddings:
    n -= params["wpe"].size
  return n


def flops_per_token(config: ModelConfig, n_params: int) -> float:
  """Training FLOPs per token, dense (nanoGPT/PaLM): 6N + 12 L T C for attention."""
  return 6 * n_params + 12 * config.num_layers * config.seq_len * config.d_model
