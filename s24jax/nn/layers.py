"""What both model families share: the compute dtype, attention (cuDNN flash attention where
available, MST's sparse patterns, grouped-query heads), the residual projections' init, the
FFN's activation sparsity, and the blocks unrolled or scanned with rematerialization.

GPT-2 (s24jax/nn/model.py) and the Llama-style family (s24jax/nn/llama.py) are built from these and
from the sparse layers of s24jax/nn/sparse_linear.py; `cfg` is the frozen `model.ModelConfig`.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from s24jax.nn import act_sparsity
from s24jax.methods.mst import attention_masks
from s24jax.nn import losses
from s24jax.kernels import _common
from s24jax.nn.sparse_linear import LINEAR_OUTPUT
from s24jax.nn.sparse_linear import SparseLinear

# Rematerialisation of each block's activations in the backward pass (jax.checkpoint):
# 'save_dots' keeps the outputs of the weight matmuls and recomputes the rest (attention
# softmax, activations, norms); 'full' keeps only the block input. The weight matmuls are the
# linear layers, dense or 2:4 sparse, whose output y is named (sparse_linear.LINEAR_OUTPUT):
# a sparse layer's GEMMs hide inside a custom_vjp (a cuSPARSELt call is no dot at all), and a
# dense layer's dot writes float32 before its cast, so by name both recipes keep the same
# tensors, y in the compute dtype (docs/scaling.md, "Equal recompute"). Any other dot without
# batch dimensions is kept as before.
REMAT_POLICIES = {"none": None, "full": None,
                  "save_dots": jax.checkpoint_policies.save_from_both_policies(
                      jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                      jax.checkpoint_policies.save_only_these_names(LINEAR_OUTPUT))}
# The variable collections a scanned block stacks along its leading (layer) axis.
SCANNED_COLLECTIONS = {"params": 0, "sparsity": 0, "prepared": 0, "intermediates": 0}


def compute_dtype(name: str) -> jnp.dtype:
  """'auto' is bfloat16 on accelerators and float32 on CPU (no fast bf16 matmul there), for
  the device the step is built for (kernels._common.target_device: a step put on the CPU of a
  GPU host computes in float32)."""
  if name == "auto":
    return jnp.float32 if _common.target_device().platform == "cpu" else jnp.bfloat16
  return jnp.dtype(name)


# model.matmul_precision: 'default' leaves JAX's (TF32 for float32 dots on an NVIDIA GPU).
MATMUL_PRECISIONS = ("default", "high", "highest")


def matmul_precision(cfg: Any):
  """The context the model's dots are traced in: jax.default_matmul_precision of
  cfg.matmul_precision ('default': no change)."""
  if cfg.matmul_precision == "default":
    return contextlib.nullcontext()
  return jax.default_matmul_precision(cfg.matmul_precision)


# What cuDNN's flash attention takes (jax._src.cudnn.fused_attention_stablehlo, jax 0.10-0.12:
# `check_is_flash_attention` and the dtype check): 16-bit inputs, a head dim that is a multiple
# of 8 and at most 128 (256 from Hopper on; 128 holds on every GPU).
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128


def attention_implementation(cfg: Any, q: jax.Array) -> str:
  """'cudnn' or 'xla' for jax.nn.dot_product_attention on q (B, T, N, hd). 'auto' is cuDNN's
  flash attention on a GPU for causal attention that cuDNN takes (CUDNN_DTYPES, the head
  dim), else XLA's: a float32 model or an odd head width on a GPU runs, it is not refused.
  The GPU is the device the step is built for (`_common.target_device`): a step put on the CPU
  of a GPU host runs XLA's, a deviceless compile for a GPU (kernels/aot.py) cuDNN's."""
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  head_dim = q.shape[-1]
  cudnn_takes = (q.dtype in CUDNN_DTYPES and head_dim % 8 == 0
                 and head_dim <= CUDNN_MAX_HEAD_DIM)
  on_gpu = _common.target_device().platform == "gpu"
  return "cudnn" if cfg.attention == "causal" and on_gpu and cudnn_takes else "xla"


def attend(cfg: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal attention of q (B, T, N, hd) over k, v (B, T, K, hd), N a multiple of K (grouped-
  query heads share their key/value head): dense causal, or the model's sparse pattern
  (MST's Hybrid Sparse Attention, which includes causality). -> (B, T, N, hd)."""
  if cfg.attention == "causal":
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation=attention_implementation(cfg, q))
  mask = attention_masks.attention_mask(cfg.attention, q.shape[1], cfg.attention_stride)  # (T, T)
  return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])


def residual_projection(cfg: Any, features: int, name: str, **kwargs) -> SparseLinear:
  """The linear layer writing into the residual stream, initialised with std
  0.02 / sqrt(2 L) (GPT-2: the residual sum over 2 L layers keeps its scale)."""
  return SparseLinear(features, cfg.sparsity, dtype=compute_dtype(cfg.dtype),
                      kernel_init=nn.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers)),
                      name=name, **kwargs)


def sparse_activations(module: nn.Module, cfg: Any, h: jax.Array):
  """The FFN's hidden activations h (B, T, H) as the second matmul takes them: V:N:M sparse
  with the activation backend's matmul under activation sparsity (Haziza et al.), else
  unchanged with the layer's own matmul (None). Sows the activation statistics when the
  'intermediates' collection is mutable (training/diagnostics.activation_stats only)."""
  act = cfg.act
  mask, matmul, h_sparse = None, None, h
  if act.enabled:
    h_sparse, mask, meta = act_sparsity.sparsify(h, act.v, act.n, act.m, backend=act.backend)
    matmul = act_sparsity.act_matmul(meta, act.v, act.backend)
  if module.is_mutable_collection("intermediates") and not module.is_initializing():
    # Only in training/diagnostics.activation_stats' forward pass; train/eval steps skip this.
    stats = act_sparsity.activation_sparsity_stats(h, act.v, act.n, act.m, mask)
    for name, value in stats.items():
      module.sow("intermediates", f"act_{name}", value)
  return (h_sparse if mask is not None else h), matmul                   # (B, T, H)


def _scanned(block: type[nn.Module]) -> type[nn.Module]:
  """`block` with the (carry, x) -> (carry, y) signature of nn.scan."""
  class Scanned(block):
    def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:   # pylint: disable=arguments-differ
      return super().__call__(x), None
  Scanned.__name__ = f"Scanned{block.__name__}"
  return Scanned


def stack(block: type[nn.Module], cfg: Any, x: jax.Array) -> jax.Array:
  """The L blocks of class `block`: unrolled ('h_0' ... 'h_{L-1}') or one nn.scan ('h',
  stacked along the leading axis), each rematerialized per cfg.remat."""
  policy = REMAT_POLICIES[cfg.remat]
  if not cfg.scan_layers:
    layer = block if cfg.remat == "none" else nn.remat(block, policy=policy)
    for i in range(cfg.num_layers):
      x = layer(cfg, name=f"h_{i}")(x)
    return x
  layer = (_scanned(block) if cfg.remat == "none"
           else nn.remat(_scanned(block), policy=policy, prevent_cse=False))
  scanned = nn.scan(layer, length=cfg.num_layers, variable_axes=SCANNED_COLLECTIONS,
                    split_rngs={"params": True, "mvue": True})
  x, _ = scanned(cfg, name="h")(x, None)
  return x


def logits_or_loss(cfg: Any, x: jax.Array, targets: jax.Array | None, *,
                   logits: Any, chunked_head: Any) -> jax.Array:
  """A model's output from its final hidden states x (B, T, C) in the compute dtype: the
  logits (B, T, V) in float32 (`logits(x)`), or with targets (B, T) the summed token
  cross-entropy, chunked over `chunked_head()` when `loss_chunk` (never the whole logits)."""
  if targets is not None and cfg.loss_chunk:
    return losses.chunked_cross_entropy_sum(x, targets, chunked_head(), cfg.loss_chunk)
  out = logits(x).astype(jnp.float32)                                        # (B, T, V)
  if targets is not None:
    return losses.cross_entropy_sum(out, targets)
  return out
