"""Tests for s24jax/methods/s_ste.py (docs/algorithms.md, "S-STE"): the soft threshold (now
s24jax.kernels.masks.soft_threshold24, which the method calls), its least-squares scale, the
projection's forward and straight-through backward, the fixed / recomputed scale in training
and in checkpoints.

References are independent NumPy code (per-group loops, np.linalg.lstsq, a scan over beta),
not copies of the library's vectorised implementation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.training import checkpoint as ckpt_lib
from s24jax.training import config as config_lib
from s24jax.nn import model as model_lib
from s24jax import state as state_lib
from s24jax.training import train
from s24jax.kernels import masks
from s24jax.methods import registry
from s24jax.methods import s_ste

from method_helpers import fresh_model_state, fwd_bwd, rand, random_batch

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")


def _hard(w):
  """The STE method's hard-threshold 2:4 projection (what the soft threshold is compared to)."""
  return registry.get_method("ste").project(w, {})


def np_soft_threshold(w):
  out = np.zeros_like(w).reshape(-1, 4)
  for i, grp in enumerate(w.reshape(-1, 4)):
    t = sorted(abs(grp))[1]
    out[i] = [np.sign(a) * max(abs(a) - t, 0.0) for a in grp]
  return out.reshape(w.shape)


def test_s_ste_forward_scale_and_straight_through_backward():
  w = rand(3)
  y, dw, g, state = fwd_bwd("s_ste", w)
  s = np_soft_threshold(w.astype(np.float64))
  beta = (w * s).sum() / (s * s).sum()
  np.testing.assert_allclose(float(state["scale"]), beta, rtol=1e-5)
  np.testing.assert_allclose(y, beta * s, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(dw, g)   # not multiplied by beta
  assert beta > 1.0   # the soft threshold shrinks, the scale compensates


def test_s_ste_scale_is_state_not_recomputed():
  """The forward uses the scale it is given (the frozen one), not one from the current w."""
  w = rand(4)
  proj = registry.get_method("s_ste")
  y = proj.project(jnp.asarray(w), {"scale": jnp.float32(2.0)})
  np.testing.assert_allclose(np.asarray(y), 2.0 * np_soft_threshold(w), rtol=1e-6, atol=1e-7)


def test_the_layer_state_holds_the_scale_and_the_mask_of_the_soft_threshold():
  """init_layer: the scale, and the 'mask' every sparse layer needs: the support of S(w),
  which is the hard 2:4 mask where no group has ties."""
  w = rand(7)
  layer = registry.get_method("s_ste").init_layer(jnp.asarray(w))
  assert set(layer) == {"scale", "mask"}
  np.testing.assert_array_equal(np.asarray(layer["mask"]), np_soft_threshold(w) != 0)
  assert layer["mask"].dtype == jnp.bool_ and layer["scale"].shape == ()


# ---------------------------------------------------------------------------------------------
# The soft threshold (s24jax.kernels.masks.soft_threshold24).


def _soft_threshold_np(w: np.ndarray) -> np.ndarray:
  """Brute force, one group of 4 at a time: subtract the 2nd-smallest |w_i| from the top two."""
  out = np.zeros_like(w)
  flat_w, flat_out = w.reshape(-1, 4), out.reshape(-1, 4)
  for g, o in zip(flat_w, flat_out):
    t = sorted(abs(float(v)) for v in g)[1]
    for i, v in enumerate(g):
      o[i] = np.sign(v) * max(abs(float(v)) - t, 0.0)
  return out


# ---------------------------------------------------------------------------------------------
# The soft threshold.


def test_soft_threshold_hand_computed():
  w = jnp.array([[3.0, -1.0, 0.5, -2.0],     # t = 1: [2, 0, 0, -1]
                 [1.0, 1.0, 1.0, 1.0],       # all tied: t = 1, everything 0
                 [0.0, -4.0, 0.0, 2.5]])     # t = 0: unchanged
  want = np.array([[2.0, 0.0, 0.0, -1.0],
                   [0.0, 0.0, 0.0, 0.0],
                   [0.0, -4.0, 0.0, 2.5]], np.float32)
  np.testing.assert_array_equal(masks.soft_threshold24(w), want)


@pytest.mark.parametrize("shape", [(3, 16), (2, 5, 8)])
def test_soft_threshold_matches_brute_force(shape):
  w = np.array(jax.random.normal(jax.random.PRNGKey(sum(shape)), shape))
  # Ties (within a group, across signs) and zeros too.
  flat = w.reshape(-1, 4)
  flat[0] = [0.3, -0.3, 0.3, 0.1]
  flat[1] = [0.0, 0.0, -0.2, 0.0]
  flat[2] = [-0.7, 0.7, 0.2, -0.2]
  got = np.asarray(masks.soft_threshold24(jnp.asarray(w)))
  np.testing.assert_allclose(got, _soft_threshold_np(w), rtol=0, atol=1e-6)
  # At most two survivors in every group of 4, and they are among the hard-threshold's kept.
  assert ((got.reshape(-1, 4) != 0).sum(-1) <= 2).all()
  assert not np.any(got[~np.asarray(masks.nm_mask(jnp.asarray(w)))])


def test_soft_threshold_is_continuous_where_hard_threshold_jumps():
  # Entries 1 and 2 cross magnitudes as eps goes from -1e-3 to +1e-3.
  def group(eps):
    return jnp.array([[1.0, 0.5, 0.5 + eps, 0.1]])

  below, above = group(-1e-3), group(1e-3)
  dw = float(jnp.max(jnp.abs(above - below)))
  soft = float(jnp.max(jnp.abs(masks.soft_threshold24(above)
                               - masks.soft_threshold24(below))))
  hard = float(jnp.max(jnp.abs(_hard(above) - _hard(below))))
  assert hard > 0.49             # the hard threshold swaps which 0.5 it keeps: a jump
  assert soft <= 2 * dw + 1e-7   # the soft threshold moves by O(dw)


def test_soft_threshold_is_lipschitz():
  # Every output is |w_i| minus an order statistic, each 1-Lipschitz in the max norm:
  # |S(w + d) - S(w)| <= 2 max|d| entrywise, whatever the mask does.
  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  w = jax.random.normal(k1, (64, 32))
  d = 1e-2 * jax.random.normal(k2, (64, 32))
  change = jnp.max(jnp.abs(masks.soft_threshold24(w + d) - masks.soft_threshold24(w)))
  assert float(change) <= 2 * float(jnp.max(jnp.abs(d))) + 1e-6
  # ...while the hard threshold flips some groups and jumps by far more than that.
  hard_change = jnp.max(jnp.abs(_hard(w + d) - _hard(w)))
  assert float(hard_change) > 10 * float(jnp.max(jnp.abs(d)))


# ---------------------------------------------------------------------------------------------
# The scale beta.


def test_scale_is_least_squares_minimiser():
  w = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (16, 24)))
  s = _soft_threshold_np(w)
  beta_lstsq = np.linalg.lstsq(s.reshape(-1, 1), w.reshape(-1), rcond=None)[0][0]
  beta = float(s_ste.s_ste_scale(jnp.asarray(w)))
  np.testing.assert_allclose(beta, beta_lstsq, rtol=1e-5)
  # A scan over beta: the residual is smallest at (the grid point nearest) beta.
  grid = np.linspace(0.5 * beta, 1.5 * beta, 2001)
  residual = [np.sum((w - b * s) ** 2) for b in grid]
  assert abs(grid[int(np.argmin(residual))] - beta) <= grid[1] - grid[0]
  assert beta > 1.0    # S shrinks the survivors, so the best scale enlarges them


def test_scale_of_all_zero_tensor_is_one():
  assert float(s_ste.s_ste_scale(jnp.zeros((4, 8)))) == 1.0


def test_s_ste_forward_is_scaled_soft_threshold_and_backward_is_straight_through():
  w = jax.random.normal(jax.random.PRNGKey(3), (8, 16))
  beta = jnp.asarray(1.7, jnp.float32)
  np.testing.assert_allclose(s_ste.s_ste24(w, beta),
                             1.7 * _soft_threshold_np(np.asarray(w)), rtol=1e-6, atol=1e-6)
  g = jax.random.normal(jax.random.PRNGKey(4), (8, 16))
  dw, dbeta = jax.vjp(s_ste.s_ste24, w, beta)[1](g)
  np.testing.assert_array_equal(dw, g)        # not multiplied by beta, not masked
  assert float(dbeta) == 0.0                  # beta is frozen state


# ---------------------------------------------------------------------------------------------
# The scale in the train state: fixed, recomputed every k steps, checkpointed.


def _tiny_config(rescale_every: int = 0):
  c = config_lib.apply_variant(config_lib.base_config(), "tiny")
  c.sparsity.method = "s_ste"
  c.sparsity.s_ste.rescale_every = rescale_every
  c.model.vocab_size = 64
  c.model.seq_len = 8
  c.model.num_layers, c.model.num_heads, c.model.d_model = 1, 2, 16
  c.optim.warmup_steps = 1
  c.optim.lr = 3e-2     # large, so the weights (and a recomputed beta) visibly move
  return c


def _scales(sparsity) -> dict[tuple[str, ...], float]:
  return {p: float(state_lib.get_path(sparsity, p)["scale"])
          for p in state_lib.sparse_layer_paths(sparsity)}


def test_initial_scale_is_s_ste_scale_of_initial_kernel():
  _, _, state = fresh_model_state(_tiny_config(), seed=0)
  paths = state_lib.sparse_layer_paths(state.sparsity)
  assert [p[1:] for p in paths] == [("mlp", "fc"), ("mlp", "proj")]
  for p, beta in _scales(state.sparsity).items():
    kernel = state_lib.get_path(state.params, p)["kernel"]
    np.testing.assert_allclose(beta, float(s_ste.s_ste_scale(kernel)), rtol=1e-6)


@pytest.mark.parametrize("rescale_every", [0, 3])
def test_scale_recomputed_exactly_every_k_steps(rescale_every):
  config = _tiny_config(rescale_every)
  model, tx, state = fresh_model_state(config, seed=0)
  rng = np.random.default_rng(0)
  initial = _scales(state.sparsity)
  previous = initial
  for step in range(1, 8):
    state, metrics = train.train_step(state, random_batch(rng, seq_len=8), model=model, tx=tx)
    assert int(state.step) == step
    scales = _scales(state.sparsity)
    for p, beta in scales.items():
      kernel = state_lib.get_path(state.params, p)["kernel"]
      if rescale_every and step % rescale_every == 0:
        np.testing.assert_allclose(beta, float(s_ste.s_ste_scale(kernel)), rtol=1e-6)
        assert beta != previous[p], (step, p)     # the weights moved, so beta did too
      else:
        assert beta == previous[p], (step, p)     # untouched between recomputations
      assert float(metrics[f"method/scale/{state_lib.layer_name(p)}"]) == beta
    np.testing.assert_allclose(float(metrics["method/scale"]), np.mean(list(scales.values())),
                               rtol=1e-6)
    previous = scales
  if not rescale_every:
    assert previous == initial


def test_scale_restored_from_checkpoint_unchanged(tmp_path):
  config = _tiny_config()
  model, tx, state = fresh_model_state(config, seed=0)
  rng = np.random.default_rng(1)
  state, _ = train.train_step(state, random_batch(rng, seq_len=8), model=model, tx=tx)
  saved = _scales(state.sparsity)
  saved_arrays = jax.device_get(state.sparsity)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(1, state, force=True)
  ckpt.close()

  # Restore into a state built from another seed, whose scales differ.
  _, _, other = fresh_model_state(config, seed=5)
  assert _scales(other.sparsity) != saved
  restored = ckpt_lib.Checkpointer(str(tmp_path), async_save=False).restore_or_init(other)
  assert int(restored.step) == 1
  assert _scales(restored.sparsity) == saved                       # bit-exact
  for p in state_lib.sparse_layer_paths(saved_arrays):
    got = state_lib.get_path(restored.sparsity, p)["scale"]
    assert got.dtype == jnp.float32 and got.shape == ()
    np.testing.assert_array_equal(got, state_lib.get_path(saved_arrays, p)["scale"])


def test_negative_rescale_every_is_rejected():
  c = _tiny_config(rescale_every=-1)
  with pytest.raises(ValueError, match="rescale_every"):
    model_lib.model_config(c)
