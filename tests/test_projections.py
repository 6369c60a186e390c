"""Each projection's forward and backward against a NumPy computation of its rule
(docs/algorithms.md: "STE", "SR-STE", "S-STE")."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import masks
from s24jax.methods import base
from s24jax.methods import registry
from s24jax.methods import s_ste


def np_mask24(w):
  """Keep the 2 largest |w| of every 4 along the last axis; ties to the lower index."""
  g = np.abs(w).reshape(-1, 4)
  order = np.argsort(-g, axis=1, kind="stable")
  m = np.zeros_like(g, dtype=bool)
  np.put_along_axis(m, order[:, :2], True, axis=1)
  return m.reshape(w.shape)


def np_soft_threshold(w):
  out = np.zeros_like(w).reshape(-1, 4)
  for i, grp in enumerate(w.reshape(-1, 4)):
    t = sorted(abs(grp))[1]
    out[i] = [np.sign(a) * max(abs(a) - t, 0.0) for a in grp]
  return out.reshape(w.shape)


def _rand(seed, shape=(8, 16)):
  return np.asarray(jax.random.normal(jax.random.key(seed), shape), np.float32)


def _fwd_bwd(name, w, seed=1, **fields):
  proj = dataclasses.replace(registry.get_method(name), **fields)
  state = proj.init_layer(jnp.asarray(w))
  g = _rand(seed, w.shape)
  y, vjp = jax.vjp(lambda w_: proj.project(w_, state), jnp.asarray(w))
  (dw,) = vjp(jnp.asarray(g))
  return np.asarray(y), np.asarray(dw), g, state


def test_dense_is_identity():
  w = _rand(0)
  y, dw, g, _ = _fwd_bwd("dense", w)
  np.testing.assert_array_equal(y, w)
  np.testing.assert_array_equal(dw, g)


def test_ste_forward_hard_threshold_backward_identity():
  w = _rand(0)
  y, dw, g, _ = _fwd_bwd("ste", w)
  np.testing.assert_array_equal(y, np.where(np_mask24(w), w, 0))
  np.testing.assert_array_equal(dw, g)
  assert ((y != 0).reshape(-1, 4).sum(1) == 2).all()


@pytest.mark.parametrize("placement,lam", [("backward", 0.3), ("gradients", 0.3),
                                           ("weights", 0.3), ("backward", 0.0)])
def test_sr_ste_backward_adds_masked_decay_only_in_backward_placement(placement, lam):
  w = _rand(2)
  y, dw, g, _ = _fwd_bwd("sr_ste", w, decay=lam, decay_placement=placement)
  m = np_mask24(w)
  np.testing.assert_array_equal(y, np.where(m, w, 0))
  expected = g + (lam * (~m) * w if placement == "backward" else 0.0)
  np.testing.assert_allclose(dw, expected, rtol=1e-6, atol=1e-7)


def test_s_ste_forward_scale_and_straight_through_backward():
  w = _rand(3)
  y, dw, g, state = _fwd_bwd("s_ste", w)
  s = np_soft_threshold(w.astype(np.float64))
  beta = (w * s).sum() / (s * s).sum()
  np.testing.assert_allclose(float(state["scale"]), beta, rtol=1e-5)
  np.testing.assert_allclose(y, beta * s, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(dw, g)   # not multiplied by beta
  assert beta > 1.0   # the soft threshold shrinks, the scale compensates


def test_s_ste_scale_is_state_not_recomputed():
  """The forward uses the scale it is given (the frozen one), not one from the current w."""
  w = _rand(4)
  proj = registry.get_method("s_ste")
  y = proj.project(jnp.asarray(w), {"scale": jnp.float32(2.0)})
  np.testing.assert_allclose(np.asarray(y), 2.0 * np_soft_threshold(w), rtol=1e-6, atol=1e-7)


def test_masks_match_forward_support():
  w = _rand(5)
  for name in ("ste", "sr_ste", "s_ste"):
    proj = registry.get_method(name)
    layer = proj.init_layer(jnp.asarray(w))
    y = proj.project(jnp.asarray(w), layer)
    np.testing.assert_array_equal(np.asarray(proj.mask(jnp.asarray(w), layer)),
                                  np.asarray(y) != 0)


def test_unknown_projection_lists_valid_names():
  with pytest.raises(ValueError) as e:
    registry.get_method("s-ste")
  for name in ("dense", "ste", "sr_ste", "s_ste"):
    assert name in str(e.value)


def test_register_plain_function_and_protect_builtins():
  @jax.custom_vjp
  def half(w):
    return jnp.where(masks.nm_mask(w, 1, 4), w, 0)   # 1:4, hard

  half.defvjp(lambda w: (half(w), None), lambda _, g: (g,))
  try:
    registry.register_projection("test_one_of_four", half)
    proj = registry.get_method("test_one_of_four")
    assert "test_one_of_four" in registry.available_methods()
    w = _rand(6)
    y = np.asarray(proj.project(jnp.asarray(w), {}))
    assert ((y != 0).reshape(-1, 4).sum(1) == 1).all()
    np.testing.assert_array_equal(np.asarray(proj.mask(jnp.asarray(w), {})), y != 0)
    with pytest.raises(ValueError, match="already registered"):
      registry.register_projection("ste", half)
  finally:
    registry._REGISTRY.pop("test_one_of_four", None)


def test_non_multiple_of_four_names_the_dimension():
  with pytest.raises(ValueError, match="multiple of 4"):
    s_ste.soft_threshold24(jnp.ones((4, 6)))
