"""Tests for s24jax/methods/straight_through.py: `masked(w, mask, decay)`, the one
straight-through rule every hard-mask method projects with.

The reference is NumPy, written from the rule: forward np.where(mask, w, 0); backward
g (decay 0) or g + decay * (1 - mask) * w (decay > 0), on random w, mask and g. It is checked
eagerly, under jit and under vmap; the bool mask gets no cotangent. Then each method that
projects with it (STE, SR-STE with decay_placement='backward', T-SR-STE, MST) is checked to
give exactly the primitive's forward and VJP on a random kernel, with its own mask and decay.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.kernels import masks
from s24jax.methods import registry
from s24jax.methods import straight_through


def _normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _bool(seed, shape, p=0.5):
  return np.random.default_rng(seed).random(shape) < p


def _np_masked(w, mask):
  return np.where(mask, w, 0).astype(w.dtype)


def _np_vjp(w, mask, g, decay):
  if not decay:
    return g
  return g + decay * (1.0 - mask.astype(np.float32)) * w


def _fwd_vjp(fn, w, g):
  y, vjp = jax.vjp(fn, jnp.asarray(w))
  (dw,) = vjp(jnp.asarray(g))
  return np.asarray(y), np.asarray(dw)


@pytest.mark.parametrize("decay", [0.0, 0.3, 2e-4])
@pytest.mark.parametrize("shape", [(8, 16), (3, 4, 12)])
def test_forward_and_vjp_match_the_numpy_rule(decay, shape):
  w, g, mask = _normal(1, shape), _normal(2, shape), _bool(3, shape)
  assert 0 < mask.mean() < 1
  y, dw = _fwd_vjp(lambda w_: straight_through.masked(w_, jnp.asarray(mask), decay), w, g)
  np.testing.assert_array_equal(y, _np_masked(w, mask))
  if decay:
    np.testing.assert_allclose(dw, _np_vjp(w, mask, g, decay), rtol=1e-6, atol=1e-7)
    assert not np.allclose(dw, g)                    # the decay term is there ...
    np.testing.assert_array_equal(dw[mask], g[mask])  # ... only on the pruned entries
  else:
    np.testing.assert_array_equal(dw, g)             # plain identity: pruned entries too


def test_the_bool_mask_gets_no_cotangent():
  w, g, mask = _normal(4, (4, 8)), _normal(5, (4, 8)), _bool(6, (4, 8))
  for decay in (0.0, 0.5):
    _, vjp = jax.vjp(lambda w_, m_: straight_through.masked(w_, m_, decay),
                     jnp.asarray(w), jnp.asarray(mask))
    dw, dmask = vjp(jnp.asarray(g))
    np.testing.assert_allclose(np.asarray(dw), _np_vjp(w, mask, g, decay), rtol=1e-6, atol=1e-7)
    # A bool primal's cotangent is float0 (symbolic zero): nothing flows into the mask.
    assert dmask.dtype == jax.dtypes.float0 and dmask.shape == mask.shape


@pytest.mark.parametrize("decay", [0.0, 0.25])
def test_under_jit_and_vmap(decay):
  w, g, mask = _normal(7, (5, 4, 8)), _normal(8, (5, 4, 8)), _bool(9, (5, 4, 8))

  def fwd_bwd(w_, m_, g_):
    y, vjp = jax.vjp(lambda a: straight_through.masked(a, m_, decay), w_)
    return y, vjp(g_)[0]

  want_y, want_dw = _np_masked(w, mask), _np_vjp(w, mask, g, decay)
  args = (jnp.asarray(w), jnp.asarray(mask), jnp.asarray(g))
  for f in (jax.jit(fwd_bwd), jax.vmap(fwd_bwd), jax.jit(jax.vmap(fwd_bwd))):
    y, dw = f(*args)
    np.testing.assert_array_equal(np.asarray(y), want_y)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-6, atol=1e-7)
  # jax.grad of a scalar loss through it, jitted: the same rule with g = d loss / d W~.
  c = jnp.asarray(g)
  grad = jax.jit(jax.grad(lambda w_: jnp.sum(c * straight_through.masked(w_, args[1], decay))))
  np.testing.assert_allclose(np.asarray(grad(args[0])), want_dw, rtol=1e-6, atol=1e-7)


def test_the_dtype_of_w_is_kept():
  w = _normal(10, (4, 8)).astype(jnp.bfloat16)
  mask = _bool(11, (4, 8))
  y, vjp = jax.vjp(lambda w_: straight_through.masked(w_, jnp.asarray(mask), 0.5),
                   jnp.asarray(w))
  (dw,) = vjp(jnp.ones((4, 8), jnp.bfloat16))
  assert y.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------------
# The methods project with it.


def _method_case(name, w):
  """(method, its layer state, the mask and the decay it must hand to `masked`)."""
  kernel = jnp.asarray(w)
  if name == "ste":
    m = registry.get_method("ste")
    return m, m.init_layer(kernel), np.asarray(masks.nm_mask(kernel)), 0.0
  if name == "sr_ste":
    m = dataclasses.replace(registry.get_method("sr_ste"), decay=0.3,
                            decay_placement="backward")
    return m, m.init_layer(kernel), np.asarray(masks.nm_mask(kernel)), 0.3
  if name == "t_sr_ste":
    # A cached transposable mask made from other weights: the projection must read the
    # layer's mask, not recompute one from the kernel.
    m = dataclasses.replace(registry.get_method("t_sr_ste"), decay=0.2,
                            decay_placement="backward")
    cached = masks.transposable_mask(jnp.asarray(_normal(99, w.shape)))
    assert (np.asarray(cached) != np.asarray(masks.transposable_mask(kernel))).any()
    layer = {**m.init_layer(kernel), "mask": cached}
    return m, layer, np.asarray(cached), 0.2
  assert name == "mst"
  m = registry.get_method("mst")
  mask = _bool(98, w.shape, p=0.4)
  return m, {"mask": jnp.asarray(mask)}, mask, 0.0


@pytest.mark.parametrize("name", ["ste", "sr_ste", "t_sr_ste", "mst"])
def test_each_hard_mask_method_projects_with_the_primitive(name):
  w, g = _normal(20, (16, 32)), _normal(21, (16, 32))
  method, layer, mask, decay = _method_case(name, w)
  y, dw = _fwd_vjp(lambda w_: method.project(w_, layer), w, g)
  y_st, dw_st = _fwd_vjp(lambda w_: straight_through.masked(w_, jnp.asarray(mask), decay), w, g)
  np.testing.assert_array_equal(y, y_st)
  np.testing.assert_array_equal(dw, dw_st)
  # ... and the primitive's result is the NumPy rule (so the method's is).
  np.testing.assert_array_equal(y, _np_masked(w, mask))
  np.testing.assert_allclose(dw, _np_vjp(w, mask, g, decay), rtol=1e-6, atol=1e-7)
  if decay:
    assert not np.array_equal(dw, g)
