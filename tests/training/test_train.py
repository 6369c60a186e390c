"""Tests for s24jax/training/train.py: gradient accumulation is the same math as one big batch (the
k = 1 step as the reference, for a dense, a stateless and a stateful sparse method), and
with MVUE each micro-batch draws its own key: the accumulated gradient equals the sum of
separate `value_and_grad`s of the model, written out here with fold_in(key, i) per
micro-batch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.training import train
from s24jax import state as state_lib

from train_helpers import tiny_setup

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("projection,overrides", [
    ("dense", {}),
    ("s_ste", {"sparsity.mvue": False, "sparsity.fp8": False}),
    ("t_sr_ste", {"sparsity.t_sr_ste.decay": 1e-2, "sparsity.t_sr_ste.mask_refresh_every": 2}),
])
def test_accumulation_is_the_same_math_as_one_big_batch(projection, overrides):
  cfg, model, tx, state, batch = tiny_setup(projection, overrides)
  runs = {}
  for k in (1, 4):
    st, losses_ = _copy(state), []
    for _ in range(3):
      st, m = train.train_step(st, batch, model=model, tx=tx, accum_steps=k)
      losses_.append(float(m["loss"]) / float(m["count"]))
    runs[k] = (st, losses_)
  np.testing.assert_allclose(runs[4][1], runs[1][1], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(runs[4][0].params), jax.tree.leaves(runs[1][0].params)):
    # Adam turns float-summation noise of near-zero gradients into O(lr) moves: tolerance ~lr/100
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  # the method's per-step state advanced once per step, not once per micro-batch
  assert int(runs[4][0].step) == 3
  for p in state_lib.sparse_layer_paths(runs[4][0].sparsity):
    np.testing.assert_array_equal(state_lib.get_path(runs[4][0].sparsity, p)["mask"],
                                  state_lib.get_path(runs[1][0].sparsity, p)["mask"])


def test_mvue_draws_an_independent_key_per_micro_batch():
  """With MVUE, accumulation over k micro-batches equals the sum of k separate gradients,
  micro-batch i (rows i, i+k, ...) drawn with fold_in(key, i): computed independently."""
  cfg, model, _, state, batch = tiny_setup("s_ste", {"sparsity.mvue": True, "sparsity.fp8": False})
  key = jax.random.key(7)
  grads_fn = jax.jit(train.loss_and_grads, static_argnames=("model", "accum_steps"))
  total, grads = grads_fn(state.params, state.sparsity, batch, key, model=model, accum_steps=2)
  tokens = batch["targets"].size
  one = jax.jit(jax.value_and_grad(lambda p, inputs, targets, k: model.apply(
      {"params": p, "sparsity": state.sparsity}, inputs, targets, rngs={"mvue": k}) / tokens))
  want_loss, want = 0.0, None
  for i in range(2):
    loss, g = one(state.params, batch["inputs"][i::2], batch["targets"][i::2],
                  jax.random.fold_in(key, i))
    want_loss += float(loss) * tokens
    want = g if want is None else jax.tree.map(jnp.add, want, g)
  np.testing.assert_allclose(float(total), want_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # and the keys matter: the same key for both micro-batches gives another gradient
  _, same = grads_fn(state.params, state.sparsity, batch, key, model=model, accum_steps=1)
  fc = lambda g: state_lib.get_path(g, ("h_0", "mlp", "fc"))["kernel"]   # pylint: disable=unnecessary-lambda-assignment
  assert not np.allclose(fc(grads), fc(same))
