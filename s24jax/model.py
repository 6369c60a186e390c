"""GPT-2 in flax.linen: pre-LN blocks, learned positions, tied embeddings; its frozen config.

All linear layers are `SparseLinear`; the FFN's are 2:4 sparse by default
(`SparsityConfig.sparse_layers`). Parameters are float32; `ModelConfig.dtype` is the
compute dtype. `ModelConfig`'s fields (but `sparsity` and `act`) are the config block
`config.model`, generated from here (s24jax/config.py): each default and its comment live on
the field, once.
"""
from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from s24jax import act_sparsity
from s24jax import activations
from s24jax import attention_masks
from s24jax import losses
from s24jax.methods import base as methods_base
from s24jax.methods import registry
from s24jax.act_sparsity import ActSparsityConfig
from s24jax.sparse_linear import SparseEmbed, SparseLinear, SparsityConfig

ACTIVATIONS = ("gelu", "relu", "relu2", "geglu", "swiglu")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
# Rematerialisation of each block's activations in the backward pass (jax.checkpoint):
# 'save_dots' keeps the outputs of the weight matmuls and recomputes the rest (attention
# softmax, activations, norms); 'full' keeps only the block input.
REMAT_POLICIES = {"none": None, "full": None,
                  "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """GPT-2 hyper-parameters and what is sparse (frozen: the model closes over it). The
  defaults are GPT-2 124M, dense."""
  vocab_size: int = 50304     # GPT-2's 50257 padded to a multiple of 64
  seq_len: int = 1024
  num_layers: int = 12
  num_heads: int = 12
  d_model: int = 768
  mlp_ratio: float = 4.0      # FFN hidden size = mlp_ratio * d_model
  activation: str = "gelu"    # ACTIVATIONS: gelu, relu, relu2, geglu, swiglu
  # The compute dtype ('float32', 'bfloat16', ...); parameters stay float32. 'auto':
  # bfloat16 on GPU/TPU, float32 on CPU (compute_dtype).
  dtype: str = "auto"
  # Attention pattern (s24jax/attention_masks.py): 'causal' (dense), or MST's Hybrid Sparse
  # Attention patterns 'strided' / 'local_strided' with stride (and local window) l; outside
  # MST's sparse-attention window.
  attention: str = "causal"
  attention_stride: int = 128
  # 'xla', 'cudnn' (fused flash attention: no (T, T) probabilities kept; GPU, causal only),
  # 'auto' (cudnn for causal attention on a GPU backend, xla otherwise).
  attention_impl: str = "auto"
  remat: str = "none"         # per block: 'none', 'full' (recompute all), 'save_dots'
  # The blocks as one nn.scan over stacked parameters ('h', leading axis = layer): compile
  # time stops growing with depth. Per-layer state is stacked the same way.
  scan_layers: bool = False
  loss_chunk: int = 0         # tokens per chunk of the chunked loss; 0: plain (B, T, V) logits
  sparsity: SparsityConfig = SparsityConfig()   # config.sparsity (s24jax/sparse_linear.py)
  act: ActSparsityConfig = ActSparsityConfig()  # config.act_sparsity (act_sparsity.py)

  @property
  def mlp_hidden(self) -> int:
    return int(self.mlp_ratio * self.d_model)

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"unknown model.activation {self.activation!r}; valid: "
                       f"{', '.join(ACTIVATIONS)}")
    if self.act.enabled and self.mlp_hidden % self.act.m:
      raise ValueError(f"V:N:M activation sparsity needs the FFN hidden dimension "
                       f"(model.mlp_ratio * model.d_model = {self.mlp_hidden}) to be a multiple "
                       f"of act_sparsity.m={self.act.m}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"unknown model.attention_impl {self.attention_impl!r}; valid: "
                       f"{', '.join(ATTENTION_IMPLS)}")
    if self.attention_impl == "cudnn" and self.attention != "causal":
      raise ValueError(f"model.attention_impl='cudnn' supports causal attention only; the "
                       f"{self.attention!r} pattern needs 'xla' (or 'auto')")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"unknown model.remat {self.remat!r}; valid: {', '.join(REMAT_POLICIES)}")
    if self.loss_chunk < 0:
      raise ValueError(f"model.loss_chunk must be >= 0 (0: plain loss), got {self.loss_chunk}")
    if self.d_model % self.num_heads:
      raise ValueError(f"model.d_model={self.d_model} is not divisible by "
                       f"model.num_heads={self.num_heads}")
    attention_masks.check_pattern(self.attention, self.attention_stride)
    if (self.sparsity.backend == "cusparselt" and self.sparsity.method.sparse
        and self.dtype == "float32"):
      raise ValueError("sparsity.backend='cusparselt' cannot compute in model.dtype='float32': "
                       "for float32, cuSPARSELt's 50% sparsity is 1:2, not 2:4 "
                       "(kernels/cusparselt/rules.py, R7). Use model.dtype='bfloat16' (or "
                       "'auto', bfloat16 on a GPU), or sparsity.backend='xla'.")

  def dense_twin(self) -> "ModelConfig":
    """The same model dense everywhere: weights and (Haziza et al.) activations."""
    return dataclasses.replace(
        self, sparsity=dataclasses.replace(self.sparsity, method=registry.get_method("dense")),
        act=ActSparsityConfig())

  def describe(self) -> str:
    """'s_ste + venom act 64:2:8 | 2L 128d', for plot titles."""
    act = f" + {self.act.describe()}" if self.act.enabled else ""
    return f"{self.sparsity.method.name}{act} | {self.num_layers}L {self.d_model}d"


# The fields of a config block that are not a dataclass's (they configure something else).
MODEL_BLOCK_EXCLUDE = ("sparsity", "act")     # ModelConfig: the other two blocks


def _fields(cls, block, exclude=()) -> dict:
  """The values of `cls`'s fields in a config block (lists back to tuples)."""
  names = [f.name for f in dataclasses.fields(cls) if f.name not in exclude]
  return {k: (tuple(block[k]) if isinstance(block[k], list) else block[k]) for k in names}


def model_config(config: ml_collections.ConfigDict,
                 method: methods_base.Method | None = None) -> ModelConfig:
  """The frozen model config of a run config; `method` defaults to registry.from_config."""
  sparsity = SparsityConfig(method=method or registry.from_config(config),
                            **_fields(SparsityConfig, config.sparsity, exclude=("method",)))
  return ModelConfig(**_fields(ModelConfig, config.model, exclude=MODEL_BLOCK_EXCLUDE),
                     sparsity=sparsity, act=ActSparsityConfig(**_fields(
                         ActSparsityConfig, config.act_sparsity)))


def compute_dtype(name: str) -> jnp.dtype:
  """'auto' is bfloat16 on accelerators and float32 on CPU (no fast bf16 matmul there)."""
  if name == "auto":
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  return jnp.dtype(name)


def _residual_projection(cfg: ModelConfig, features: int, name: str, **kwargs) -> SparseLinear:
  """The linear layer writing into the residual stream, initialised with std
  0.02 / sqrt(2 L) (GPT-2: the residual sum over 2 L layers keeps its scale)."""
  return SparseLinear(features, cfg.sparsity, dtype=compute_dtype(cfg.dtype),
                      kernel_init=nn.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers)),
                      name=name, **kwargs)


def attention_implementation(cfg: ModelConfig) -> str:
  """'cudnn' or 'xla' for jax.nn.dot_product_attention. 'auto' asks the backend, which is
  the CPU while compiling devicelessly for a GPU: the planner sets 'cudnn' explicitly."""
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  return "cudnn" if cfg.attention == "causal" and jax.default_backend() == "gpu" else "xla"


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
      y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                       implementation=attention_implementation(cfg))  # (B, T, nh, hd)
    else:   # Hybrid Sparse Attention (MST): the pattern already includes causality
      mask = attention_masks.attention_mask(cfg.attention, T, cfg.attention_stride)  # (T, T)
      y = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])       # (B, T, nh, hd)
    return _residual_projection(cfg, C, "out")(y.reshape(B, T, C))          # (B, T, C)


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
    act = cfg.act
    mask, matmul = None, None
    if act.enabled:   # Haziza et al.: V:N:M activations into the 2nd matmul
      h_sparse, mask, meta = act_sparsity.sparsify(h, act.v, act.n, act.m, backend=act.backend)
      matmul = act_sparsity.act_matmul(meta, act.v, act.backend)
    if self.is_mutable_collection("intermediates") and not self.is_initializing():
      # Only in act_sparsity.activation_stats' forward pass; train/eval steps skip this.
      stats = act_sparsity.activation_sparsity_stats(h, act.v, act.n, act.m, mask)
      for name, value in stats.items():
        self.sow("intermediates", f"act_{name}", value)
    if mask is not None:
      h = h_sparse                                                            # (B, T, H)
    return _residual_projection(cfg, C, "proj", matmul=matmul)(h)           # (B, T, C)


class Block(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = compute_dtype(self.config.dtype)
    x = x + CausalSelfAttention(self.config, name="attn")(nn.LayerNorm(dtype=dtype, name="ln_1")(x))
    x = x + MLP(self.config, name="mlp")(nn.LayerNorm(dtype=dtype, name="ln_2")(x))
    return x                                                                  # (B, T, C)


class ScannedBlock(Block):
  """A Block with the (carry, x) -> (carry, y) signature of nn.scan."""

  def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:   # pylint: disable=arguments-differ
    return super().__call__(x), None


def blocks(cfg: ModelConfig, x: jax.Array) -> jax.Array:
  """The L blocks: unrolled ('h_0' ... 'h_{L-1}') or one nn.scan ('h', stacked)."""
  policy = REMAT_POLICIES[cfg.remat]
  if not cfg.scan_layers:
    block = Block if cfg.remat == "none" else nn.remat(Block, policy=policy)
    for i in range(cfg.num_layers):
      x = block(cfg, name=f"h_{i}")(x)
    return x
  block = ScannedBlock if cfg.remat == "none" else nn.remat(ScannedBlock, policy=policy,
                                                             prevent_cse=False)
  scanned = nn.scan(block, length=cfg.num_layers,
                    variable_axes={"params": 0, "sparsity": 0, "prepared": 0,
                                   "intermediates": 0},
                    split_rngs={"params": True, "mvue": True})
  x, _ = scanned(cfg, name="h")(x, None)
  return x


class GPT2(nn.Module):
  """Token ids (B, T) -> logits (B, T, vocab) in float32; with targets (B, T): the summed
  token cross-entropy instead (chunked if `loss_chunk`, without the whole logits)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, targets: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    dtype = compute_dtype(cfg.dtype)
    B, T = tokens.shape
    if T > cfg.seq_len:
      raise ValueError(f"sequence length {T} exceeds model.seq_len={cfg.seq_len}")
    # Tied with the head; sparse (one mask for the lookup and the head) if 'wte' matches
    # sparsity.sparse_layers, e.g. MST's reference layer set.
    wte = SparseEmbed(cfg.vocab_size, cfg.d_model, sparsity=cfg.sparsity,
                      embedding_init=nn.initializers.normal(0.02), dtype=dtype, name="wte")
    wpe = self.param("wpe", nn.initializers.normal(0.01), (cfg.seq_len, cfg.d_model))
    x = (wte(tokens) + wpe[:T]).astype(dtype)                                 # (B, T, C)
    x = blocks(cfg, x)                                                        # (B, T, C)
    x = nn.LayerNorm(dtype=dtype, name="ln_f")(x)
    if targets is not None and cfg.loss_chunk:
      return losses.chunked_cross_entropy_sum(x.astype(dtype), targets, wte.head(),
                                              cfg.loss_chunk)
    logits = wte.attend(x.astype(dtype)).astype(jnp.float32)                  # (B, T, V)
    if targets is not None:
      return losses.cross_entropy_sum(logits, targets)
    return logits


def num_params(params) -> int:
  return sum(p.size for p in jax.tree.leaves(params))
