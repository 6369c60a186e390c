"""The frozen model config of both families, GPT-2 in flax.linen (pre-LN blocks, learned
positions, tied embeddings), and `build`, the model of a config.

`model.family` picks the architecture: 'gpt2' (here) or 'llama' (s24jax/nn/llama.py: RMSNorm,
rotary positions, no biases, untied embeddings, grouped-query attention, a SwiGLU FFN of
three matrices); both are made of the same sparse layers and shared pieces
(s24jax/nn/layers.py), and no method knows which family it trains. All linear layers are
`SparseLinear`; the FFN's are 2:4 sparse by default (`SparsityConfig.sparse_layers`).
Parameters are float32; `ModelConfig.dtype` is the compute dtype. `ModelConfig`'s fields
(but `sparsity` and `act`) are the config block `config.model`, generated from here
(s24jax/training/config.py): each default and its comment live on the field, once.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from s24jax.nn import activations
from s24jax.methods.mst import attention_masks
from s24jax.nn import layers
from s24jax.nn import llama
from s24jax import state as state_lib
from s24jax.methods import base as methods_base
from s24jax.methods import registry
from s24jax.nn.act_sparsity import ActSparsityConfig
from s24jax.nn.layers import compute_dtype
from s24jax.nn.sparse_linear import SparseEmbed
from s24jax.nn.sparse_linear import SparseLinear
from s24jax.nn.sparse_linear import SparsityConfig

FAMILIES = ("gpt2", "llama")
ACTIVATIONS = ("gelu", "relu", "relu2", "geglu", "swiglu")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model's hyper-parameters and what is sparse (frozen: the model closes over it). The
  defaults are GPT-2 124M, dense."""
  family: str = "gpt2"        # FAMILIES: 'gpt2' or 'llama' (s24jax/nn/llama.py)
  vocab_size: int = 50304     # GPT-2's 50257 padded to a multiple of 64
  seq_len: int = 1024
  num_layers: int = 12
  num_heads: int = 12
  d_model: int = 768
  # gpt2: FFN hidden size = mlp_ratio * d_model. llama: Llama's rule, 2/3 of mlp_ratio *
  # d_model (8/3 d) rounded up to a multiple of ffn_multiple_of (7B: 11008).
  mlp_ratio: float = 4.0
  ffn_multiple_of: int = 256
  activation: str = "gelu"    # ACTIVATIONS: gelu, relu, relu2, geglu, swiglu
  # llama only: the key/value heads of grouped-query attention (0: num_heads), the rotary
  # embedding's base, and RMSNorm's epsilon.
  num_kv_heads: int = 0
  rope_base: float = 10000.0
  norm_eps: float = 1e-5
  # The compute dtype ('float32', 'bfloat16', ...); parameters stay float32. 'auto':
  # bfloat16 on GPU/TPU, float32 on CPU (compute_dtype). On an NVIDIA GPU, 'float32' dots run
  # in TF32 (10-bit mantissa products: JAX's default precision) unless matmul_precision says
  # otherwise.
  dtype: str = "auto"
  # The precision of the model's float32 dots (layers.MATMUL_PRECISIONS, set with
  # jax.default_matmul_precision):
  # 'default' (JAX's: TF32 on an NVIDIA GPU), 'high' (bf16_3x, ~float32), 'highest' (float32,
  # several times slower on a GPU). Changes nothing on a CPU, or for 16-bit compute.
  matmul_precision: str = "default"
  # Attention pattern (s24jax/methods/mst/attention_masks.py): 'causal' (dense), or MST's Hybrid Sparse
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
  sparsity: SparsityConfig = SparsityConfig()   # config.sparsity (s24jax/nn/sparse_linear.py)
  act: ActSparsityConfig = ActSparsityConfig()  # config.act_sparsity (act_sparsity.py)

  @property
  def mlp_hidden(self) -> int:
    if self.family == "llama":
      hidden = int(2 * self.mlp_ratio * self.d_model / 3)
      return self.ffn_multiple_of * -(-hidden // self.ffn_multiple_of)
    return int(self.mlp_ratio * self.d_model)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def head_name(self) -> str:
    """The LM head's module name: GPT-2's tied embedding 'wte', Llama's untied 'lm_head'."""
    return state_lib.HEADS[self.family]

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"unknown model.family {self.family!r}; valid: {', '.join(FAMILIES)}")
    if self.family == "llama":
      llama.check_config(self)
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"unknown model.activation {self.activation!r}; valid: "
                       f"{', '.join(ACTIVATIONS)}")
    if self.act.enabled and self.mlp_hidden % self.act.m:
      raise ValueError(f"V:N:M activation sparsity needs the FFN hidden dimension "
                       f"(model.mlp_ratio * model.d_model = {self.mlp_hidden}) to be a multiple "
                       f"of act_sparsity.m={self.act.m}")
    if self.matmul_precision not in layers.MATMUL_PRECISIONS:
      raise ValueError(f"unknown model.matmul_precision {self.matmul_precision!r}; valid: "
                       f"{', '.join(layers.MATMUL_PRECISIONS)}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"unknown model.attention_impl {self.attention_impl!r}; valid: "
                       f"{', '.join(ATTENTION_IMPLS)}")
    if self.attention_impl == "cudnn" and self.attention != "causal":
      raise ValueError(f"model.attention_impl='cudnn' supports causal attention only; the "
                       f"{self.attention!r} pattern needs 'xla' (or 'auto')")
    if self.remat not in layers.REMAT_POLICIES:
      raise ValueError(f"unknown model.remat {self.remat!r}; valid: "
                       f"{', '.join(layers.REMAT_POLICIES)}")
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
    y = layers.attend(cfg, q, k, v)                                           # (B, T, nh, hd)
    return layers.residual_projection(cfg, C, "out")(y.reshape(B, T, C))    # (B, T, C)


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
    h, matmul = layers.sparse_activations(self, cfg, h)   # Haziza et al.: V:N:M into proj
    return layers.residual_projection(cfg, C, "proj", matmul=matmul)(h)     # (B, T, C)


class Block(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = compute_dtype(self.config.dtype)
    x = x + CausalSelfAttention(self.config, name="attn")(nn.LayerNorm(dtype=dtype, name="ln_1")(x))
    x = x + MLP(self.config, name="mlp")(nn.LayerNorm(dtype=dtype, name="ln_2")(x))
    return x                                                                  # (B, T, C)


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
    with layers.matmul_precision(cfg):   # TF32 or float32 dots (ModelConfig)
      # Tied with the head; sparse (one mask for the lookup and the head) if 'wte' matches
      # sparsity.sparse_layers, e.g. MST's reference layer set.
      wte = SparseEmbed(cfg.vocab_size, cfg.d_model, sparsity=cfg.sparsity,
                        embedding_init=nn.initializers.normal(0.02), dtype=dtype, name="wte")
      wpe = self.param("wpe", nn.initializers.normal(0.01), (cfg.seq_len, cfg.d_model))
      x = (wte(tokens) + wpe[:T]).astype(dtype)                                 # (B, T, C)
      x = layers.stack(Block, cfg, x)                                           # (B, T, C)
      x = nn.LayerNorm(dtype=dtype, name="ln_f")(x).astype(dtype)
      return layers.logits_or_loss(cfg, x, targets, logits=wte.attend, chunked_head=wte.head)


def build(cfg: ModelConfig) -> nn.Module:
  """The model of `cfg`: token ids (B, T) -> logits, or with targets the summed loss."""
  return GPT2(cfg) if cfg.family == "gpt2" else llama.Llama(cfg)


def num_params(params) -> int:
  return sum(p.size for p in jax.tree.leaves(params))
