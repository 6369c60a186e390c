"""The Llama-style family (`model.family='llama'`), the decoder current open pre-training
codebases train: RMSNorm, rotary position embeddings, no biases, untied input and output
embeddings, grouped-query attention, and a SwiGLU FFN of three matrices (gate, up, down; hidden
size Llama's 8/3 d rounded up, `ModelConfig.mlp_hidden`) or, with `model.activation='relu2'`,
a Squared-ReLU FFN of two (up, down) as Haziza et al. 2026 pre-train.

It is made of GPT-2's parts (s24jax/nn/layers.py: the sparse linear layers, attention with cuDNN
flash attention where available, scanning, remat, the chunked loss, activation sparsity), so
every method trains it as it trains GPT-2. Module names follow transformers' LlamaForCausalLM
up to its prefixes (s24jax/cli/export.py maps them): h_<i>/attn/{q,k,v,o}, h_<i>/mlp/{gate,up,
down}, h_<i>/{attn_norm,mlp_norm}, embed, norm, lm_head; so the default sparse layers
'*/mlp/*' are every FFN matrix, and MST's reference set ('*/attn/*', '*/mlp/*', 'lm_head')
every linear layer and the head.

Rotary embeddings are transformers' convention (`rotate_half`: the two halves of each head's
dimensions pair up, not interleaved neighbours), so an exported model computes the same logits.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from s24jax.nn import activations
from s24jax.nn import layers
from s24jax.nn.layers import compute_dtype
from s24jax.nn.sparse_linear import SparseHead
from s24jax.nn.sparse_linear import SparseLinear


def check_config(cfg: Any) -> None:
  """The Llama-style family's own constraints on a ModelConfig (model.py calls it)."""
  if cfg.num_kv_heads < 0 or cfg.num_heads % cfg.kv_heads:
    raise ValueError(f"model.num_heads={cfg.num_heads} must be a multiple of "
                     f"model.num_kv_heads={cfg.num_kv_heads} (grouped-query attention: each "
                     "key/value head serves num_heads / num_kv_heads query heads; 0 = "
                     "num_heads)")
  if (cfg.d_model // cfg.num_heads) % 2:
    raise ValueError(f"rotary embeddings rotate pairs of a head's dimensions: the head size "
                     f"model.d_model / model.num_heads = {cfg.d_model // cfg.num_heads} must "
                     "be even")
  if cfg.ffn_multiple_of < 1:
    raise ValueError(f"model.ffn_multiple_of must be >= 1, got {cfg.ffn_multiple_of}")


def rotary(x: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding of x (B, T, heads, hd) at positions 0..T-1, transformers'
  Llama convention: inv_freq_i = base^(-2i / hd), the first and second halves of hd rotated
  together (x * cos + rotate_half(x) * sin), computed in float32."""
  _, t, _, hd = x.shape
  inv_freq = 1.0 / (base ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))   # (hd/2,)
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]    # (T, hd/2)
  angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]     # (1, T, 1, hd)
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)                             # rotate_half
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def _linear(cfg: Any, features: int, name: str) -> SparseLinear:
  return SparseLinear(features, cfg.sparsity, use_bias=False, dtype=compute_dtype(cfg.dtype),
                      name=name)


class Attention(nn.Module):
  config: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    B, T, C = x.shape
    nh, nkv = cfg.num_heads, cfg.kv_heads
    hd = C // nh
    q = _linear(cfg, nh * hd, "q")(x).reshape(B, T, nh, hd)                 # (B, T, nh, hd)
    k = _linear(cfg, nkv * hd, "k")(x).reshape(B, T, nkv, hd)               # (B, T, nkv, hd)
    v = _linear(cfg, nkv * hd, "v")(x).reshape(B, T, nkv, hd)               # (B, T, nkv, hd)
    q, k = rotary(q, cfg.rope_base), rotary(k, cfg.rope_base)
    y = layers.attend(cfg, q, k, v)                                           # (B, T, nh, hd)
    return layers.residual_projection(cfg, C, "o", use_bias=False)(
        y.reshape(B, T, nh * hd))                                             # (B, T, C)


class MLP(nn.Module):
  """gated (swiglu, geglu): down(act(gate(x)) * up(x)); else down(act(up(x)))."""
  config: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    C, H = x.shape[-1], cfg.mlp_hidden
    up = _linear(cfg, H, "up")(x)                                            # (B, T, H)
    if cfg.activation in activations.GATED:
      h = activations.gated_pair(cfg.activation, up, _linear(cfg, H, "gate")(x))   # (B, T, H)
    else:
      h = activations.apply(cfg.activation, up)                              # (B, T, H)
    h, matmul = layers.sparse_activations(self, cfg, h)   # Haziza et al.: V:N:M into down
    return layers.residual_projection(cfg, C, "down", use_bias=False, matmul=matmul)(h)


class Block(nn.Module):
  config: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    norm = lambda name: nn.RMSNorm(epsilon=cfg.norm_eps, dtype=compute_dtype(cfg.dtype),   # pylint: disable=unnecessary-lambda-assignment
                                   name=name)
    x = x + Attention(cfg, name="attn")(norm("attn_norm")(x))
    x = x + MLP(cfg, name="mlp")(norm("mlp_norm")(x))
    return x                                                                  # (B, T, C)


class Llama(nn.Module):
  """Token ids (B, T) -> logits (B, T, vocab) in float32; with targets (B, T): the summed
  token cross-entropy instead (chunked if `loss_chunk`, without the whole logits)."""
  config: Any

  @nn.compact
  def __call__(self, tokens: jax.Array, targets: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    dtype = compute_dtype(cfg.dtype)
    _, T = tokens.shape
    if T > cfg.seq_len:
      raise ValueError(f"sequence length {T} exceeds model.seq_len={cfg.seq_len}")
    with layers.matmul_precision(cfg):   # TF32 or float32 dots (model.ModelConfig)
      x = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(0.02),
                   dtype=dtype, name="embed")(tokens).astype(dtype)          # (B, T, C)
      x = layers.stack(Block, cfg, x)                                         # (B, T, C)
      x = nn.RMSNorm(epsilon=cfg.norm_eps, dtype=dtype, name="norm")(x).astype(dtype)
      head = SparseHead(cfg.vocab_size, cfg.d_model, cfg.sparsity, dtype=dtype,
                        name=cfg.head_name)
      return layers.logits_or_loss(cfg, x, targets, logits=head, chunked_head=head.head)
