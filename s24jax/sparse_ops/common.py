"""The pieces every backend of the sparse linear op shares: the reference GEMMs (plain XLA,
optionally FP8), the MVUE operand of the weight gradient, FP8 scaling and the key's zero
cotangent. Shapes: x (N, in) tokens, W~ (out, in), dY (N, out)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from s24jax.sparse_ops import fp8 as fp8_lib
from s24jax.kernels import masks
from s24jax.sparse_ops.options import GemmOptions


def matmul_f32(a: jax.Array, b: jax.Array, dims) -> jax.Array:
  """dot_general with float32 accumulation (bf16 operands on GPU, float32 on CPU)."""
  return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _fp8_matmul_f32(a: jax.Array, b: jax.Array, dims, a_format, b_format,
                    opts: GemmOptions) -> jax.Array:
  """FP8 `matmul_f32`: a in `a_format`, b in `b_format`, per-tensor amax scales (the whole
  tensors' inside shard_map: `fp8_scale`; otherwise exactly fp8_lib.fp8_dot_general)."""
  qa, sa = fp8_lib.quantize(a, a_format, fp8_scale(a, a_format, opts))
  qb, sb = fp8_lib.quantize(b, b_format, fp8_scale(b, b_format, opts))
  return fp8_lib.scaled_dot_general(qa, sa, qb, sb, (dims, ((), ())), jnp.float32)


def backward_format(opts: GemmOptions):
  """The float8 dtype of W~ / x in the backward GEMMs (opts.fp8_backward_operands)."""
  return fp8_lib.FORMATS[opts.fp8_backward_operands]


def fwd_gemm(x: jax.Array, w: jax.Array, opts: GemmOptions) -> jax.Array:
  """y = x W~^T: x (N, in), W~ (out, in) 2:4 along `in` -> (N, out) float32."""
  if opts.fp8:
    return _fp8_matmul_f32(x, w, ((1,), (1,)), fp8_lib.E4M3, fp8_lib.E4M3, opts)   # (N, out)
  return matmul_f32(x, w, ((1,), (1,)))                          # (N, out)


def dgrad_gemm(dy: jax.Array, w: jax.Array, opts: GemmOptions) -> jax.Array:
  """dX = dY W~: dY (N, out), W~ (out, in) 2:4 along `out` if transposable -> (N, in) f32."""
  if opts.fp8:   # W~ quantized afresh in the backward format (e4m3: as the forward did)
    return _fp8_matmul_f32(dy, w, ((1,), (0,)), fp8_lib.E5M2, backward_format(opts),
                           opts)
  return matmul_f32(dy, w, ((1,), (0,)))                         # (N, in)


def wgrad_operand(dy: jax.Array, key: jax.Array | None, opts: GemmOptions) -> jax.Array:
  """dY^T (out, N), 2:4 along the tokens (MVUE) when opts.mvue; exact otherwise."""
  dy_t = dy.T                                                    # (out, N)
  if not opts.mvue:
    return dy_t
  check_mvue_key(key)
  n = dy_t.shape[-1]
  if n % 4:
    raise ValueError(f"MVUE makes dY^T 2:4 along the tokens, so the number of tokens per "
                     f"step (batch x sequence length, here {n}) must be a multiple of 4.")
  return masks.mvue24(key, dy_t)                                 # (out, N)


def check_mvue_key(key: jax.Array | None) -> None:
  if key is None:
    raise ValueError("the sparse linear op has sparsity.mvue=True but got no PRNG key: "
                     "apply the model with rngs={'mvue': key} when taking gradients "
                     "(train.train_step does).")


def wgrad_gemm(dy: jax.Array, x: jax.Array, key: jax.Array | None,
               opts: GemmOptions) -> jax.Array:
  """dW~ = est(dY^T) x: dY (N, out), x (N, in) -> (out, in) float32."""
  return wgrad_product(wgrad_operand(dy, key, opts), x, opts)


def wgrad_product(dy_t: jax.Array, x: jax.Array, opts: GemmOptions) -> jax.Array:
  """The weight gradient's GEMM on its operand dY^T (out, N) (`wgrad_operand`: the MVUE
  estimate with opts.mvue), x (N, in) -> (out, in) float32."""
  if opts.fp8:   # quantizes the (MVUE-)estimate itself: the GEMM's actual operand
    return _fp8_matmul_f32(dy_t, x, ((1,), (0,)), fp8_lib.E5M2, backward_format(opts),
                           opts)
  return matmul_f32(dy_t, x, ((1,), (0,)))                       # (out, in)


@jax.named_scope("fp8_quantize")   # its kernels, by name in the compiled HLO (step_census)
def fp8_scale(x: jax.Array, fmt, opts: GemmOptions) -> jax.Array:
  """FP8's per-tensor scale of x; inside shard_map from the amax of the whole tensor."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  if opts.token_axes:
    amax = jax.lax.pmax(amax, opts.token_axes)
  return fp8_lib.scale_from_amax(amax, fmt)


def key_cotangent(key: jax.Array | None):
  """The PRNG key's cotangent: none (float0 zeros), it is not differentiable."""
  return None if key is None else np.zeros(key.shape, jax.dtypes.float0)
