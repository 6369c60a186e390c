"""Tests for s24jax/methods/ste.py (docs/algorithms.md, "STE"): the hard-threshold 2:4
projection with the straight-through backward, against a NumPy statement of the rule
(the 2 largest |w| of every 4 along `in`, ties to the lower index; dL/dW := dL/dW~).
"""
import jax
import jax.numpy as jnp
import numpy as np

from s24jax.methods import registry


def np_mask24(w):
  """Keep the 2 largest |w| of every 4 along the last axis; ties to the lower index."""
  g = np.abs(w).reshape(-1, 4)
  order = np.argsort(-g, axis=1, kind="stable")
  m = np.zeros_like(g, dtype=bool)
  np.put_along_axis(m, order[:, :2], True, axis=1)
  return m.reshape(w.shape)


def _rand(seed, shape=(8, 16)):
  return np.asarray(jax.random.normal(jax.random.key(seed), shape), np.float32)


def _fwd_bwd(name, w, seed=1):
  proj = registry.get_method(name)
  state = proj.init_layer(jnp.asarray(w))
  g = _rand(seed, w.shape)
  y, vjp = jax.vjp(lambda w_: proj.project(w_, state), jnp.asarray(w))
  (dw,) = vjp(jnp.asarray(g))
  return np.asarray(y), np.asarray(dw), g, state


def test_ste_forward_hard_threshold_backward_identity():
  w = _rand(0)
  y, dw, g, _ = _fwd_bwd("ste", w)
  np.testing.assert_array_equal(y, np.where(np_mask24(w), w, 0))
  np.testing.assert_array_equal(dw, g)
  assert ((y != 0).reshape(-1, 4).sum(1) == 2).all()


def test_ste_ties_keep_the_lower_index():
  """Equal magnitudes (of either sign) in a group: the lower indices are kept, as NumPy's
  stable sort of -|w| does."""
  w = np.array([[0.5, -0.5, 0.5, 0.1, 0.0, 0.0, 0.0, 0.0],
                [-1.0, 1.0, 1.0, -1.0, 0.2, -0.3, 0.3, 0.2]], np.float32)
  y, _, _, layer = _fwd_bwd("ste", w)
  np.testing.assert_array_equal(y != 0, np_mask24(w) & (w != 0))
  np.testing.assert_array_equal(np.asarray(layer["mask"]), np_mask24(w))
