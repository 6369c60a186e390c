"""Helpers shared by the method tests (tests/methods/): a NumPy statement of the hard 2:4 mask,
random weights, a projection's forward and straight-through backward, and a tiny model's
fresh train state and random batches."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from s24jax.methods import registry
from s24jax.nn.model import GPT2
from s24jax.training.run_spec import RunSpec


def np_mask24(w):
  """Keep the 2 largest |w| of every 4 along the last axis; ties to the lower index."""
  g = np.abs(w).reshape(-1, 4)
  order = np.argsort(-g, axis=1, kind="stable")
  m = np.zeros_like(g, dtype=bool)
  np.put_along_axis(m, order[:, :2], True, axis=1)
  return m.reshape(w.shape)


def rand(seed, shape=(8, 16)):
  return np.asarray(jax.random.normal(jax.random.key(seed), shape), np.float32)


def fwd_bwd(name, w, seed=1, **fields):
  """The method `name` (with `fields` replaced) on w: (projection, its VJP of a random
  cotangent g = rand(seed), g, the layer state init_layer gave)."""
  proj = dataclasses.replace(registry.get_method(name), **fields)
  state = proj.init_layer(jnp.asarray(w))
  g = rand(seed, w.shape)
  y, vjp = jax.vjp(lambda w_: proj.project(w_, state), jnp.asarray(w))
  (dw,) = vjp(jnp.asarray(g))
  return np.asarray(y), np.asarray(dw), g, state


def fresh_model_state(config, seed=None):
  """(model, optimizer, fresh train state) of `config`; the state from `seed` (config.seed
  when None)."""
  spec = RunSpec.build(config)
  model = GPT2(spec.model_cfg)
  state = spec.fresh_state(config.seed if seed is None else seed)
  return model, spec.tx(state.params, state.sparsity), state


def random_batch(rng, seq_len=16):
  """4 random sequences of token ids below 64 (a vocab_size of 64), as inputs and targets."""
  tokens = rng.integers(0, 64, size=(4, seq_len + 1))
  return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
