"""Helpers shared by the backend tests of tests/sparse_ops/ (Pallas, tcgen05): operands, the
op's outputs and gradients on a backend, the bf16 comparison of the GPU twins against 'xla',
and a tiny model's losses over a few training steps."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from s24jax import sparse_ops
from s24jax.training import train
from s24jax.kernels import masks
from s24jax.nn.model import GPT2
from s24jax.training.run_spec import RunSpec
from s24jax.sparse_ops.options import GemmOptions

# (tokens, out, in): one that fills whole kernel tiles, one the kernels must pad on every axis
# (in = 40: not a multiple of the 64-wide K tile nor of 32, the columns per metadata word).
SHAPES = [(16, 32, 64), (6, 12, 40)]


def normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def sparse_w(seed, shape):
  w = normal(seed, shape)                                            # (out, in)
  return w * masks.nm_mask(w)                                        # W~, 2:4 along in


def op(backend, x, w, dy, key=None, mvue=False):
  """y, dX, dW~ of sparse_ops.sparse_linear on `backend` (cotangent dy)."""
  opts = GemmOptions(mvue=mvue, backend=backend)
  y, vjp = jax.vjp(lambda x, w: sparse_ops.sparse_linear(x, w, key, opts=opts), x, w)
  dx, dw = vjp(dy)
  return y, dx, dw


def assert_bf16_op_matches_xla(backend, tokens, out, inp):
  """The op on `backend` with bf16 x and dy (as the model uses on GPU) against 'xla': bf16
  outputs, f32 accumulation in both, so a few bf16 ulps of the largest entries."""
  x = normal(0, (tokens, inp)).astype(jnp.bfloat16)
  w, dy = sparse_w(1, (out, inp)), normal(2, (tokens, out)).astype(jnp.bfloat16)
  for g, r in zip(op(backend, x, w, dy), op("xla", x, w, dy)):
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    np.testing.assert_allclose(g, r, rtol=2e-2, atol=2e-2 * np.abs(r).max())


def train_losses(config, steps):
  """The per-token loss of each of `steps` train steps of the model `config` builds, on random
  tokens below 64 (config.model.vocab_size = 64), and the final parameters."""
  spec = RunSpec.build(config)
  model = GPT2(spec.model_cfg)
  state = train.fresh_state(model, spec.tx, 0)
  tx = spec.tx(state.params, state.sparsity)
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(steps):
    tokens = jnp.asarray(rng.integers(0, 64, (config.batch_size, config.model.seq_len + 1)),
                         jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}    # (B, T) each
    state, m = train.train_step(state, batch, model=model, tx=tx)
    losses.append(float(m["loss"] / m["count"]))
  return losses, jax.device_get(state.params)
