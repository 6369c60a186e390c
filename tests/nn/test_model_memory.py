"""Tests for s24jax/nn/model.py's memory options: the chunked loss (`loss_chunk`),
rematerialization (`remat`) and scanned blocks (`scan_layers`) compute the plain model's
loss and gradients. References: the plain model's loss written out here (logits, then -log
softmax at the targets), the plain model's gradients, and for the scan an independent
re-layout (the unrolled parameters and sparsity state stacked by hand)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.nn import model as model_lib
from s24jax import state as state_lib
from s24jax.methods import s_ste
from s24jax.training.run_spec import RunSpec
from s24jax.step_info import StepInfo

from tiny import tiny_config
from train_helpers import tiny_setup

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")


@pytest.mark.parametrize("overrides", [{"loss_chunk": 24}, {"loss_chunk": 7, "remat": "full"},
                                       {"remat": "save_dots"}])
def test_chunked_loss_and_remat_equal_the_plain_model(overrides):
  cfg, model, _, state, batch = tiny_setup("s_ste", {"sparsity.fp8": False})
  other = model_lib.GPT2(dataclasses.replace(model.config, **overrides))

  def value_and_grad(m):
    f = lambda p: m.apply({"params": p, "sparsity": state.sparsity}, batch["inputs"],
                          batch["targets"], rngs={"mvue": jax.random.key(0)})
    return jax.jit(jax.value_and_grad(f))(state.params)

  (l0, g0), (l1, g1) = value_and_grad(model), value_and_grad(other)
  # the plain reference written out here: logits, then -log softmax at the targets
  logits = model.apply({"params": state.params, "sparsity": state.sparsity}, batch["inputs"])
  ref = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None],
                                     -1))
  np.testing.assert_allclose(float(l0), float(ref), rtol=1e-6)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_scanned_blocks_equal_the_unrolled_model():
  """model.scan_layers: the same network as the unrolled blocks when the stacked parameters
  and sparsity state are the unrolled ones stacked (an independent re-layout)."""
  cfg = tiny_config("s_ste", overrides={"model.num_layers": 3, "sparsity.fp8": False,
                                        "sparsity.mvue": False})
  model_cfg = RunSpec.build(cfg).model_cfg
  unrolled = model_lib.GPT2(model_cfg)
  scanned = model_lib.GPT2(dataclasses.replace(model_cfg, scan_layers=True, remat="save_dots"))
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 1000)
  targets = jax.random.randint(jax.random.key(1), (2, 16), 0, 1000)
  v = unrolled.init(jax.random.key(2), tokens)

  def stack(tree):
    tree = dict(tree)
    layers = [tree.pop(f"h_{i}") for i in range(3)]
    tree["h"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return tree

  vs = {"params": stack(v["params"]), "sparsity": stack(v["sparsity"])}
  shapes = jax.eval_shape(scanned.init, jax.random.key(2), tokens)
  assert jax.tree.map(lambda x: x.shape, vs) == jax.tree.map(lambda x: x.shape, dict(shapes))
  f_u = lambda p: unrolled.apply({**v, "params": p}, tokens, targets)   # pylint: disable=unnecessary-lambda-assignment
  f_s = lambda p: scanned.apply({**vs, "params": p}, tokens, targets)   # pylint: disable=unnecessary-lambda-assignment
  (lu, gu) = jax.jit(jax.value_and_grad(f_u))(v["params"])
  (ls, gs) = jax.jit(jax.value_and_grad(f_s))(vs["params"])
  np.testing.assert_allclose(float(ls), float(lu), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(stack(gu))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # The method's per-layer work applies layer by layer to the stacked state: the S-STE
  # rescale gives each layer its own scale, and the flip rate counts every layer.
  method = dataclasses.replace(model_cfg.sparsity.method, rescale_every=1)
  before = state_lib.TrainState(step=jnp.asarray(0), params=vs["params"], opt_state=(),
                                sparsity=vs["sparsity"], method_state={},
                                rng=jax.random.key(0))
  info = StepInfo(step=0, log=True)   # next_step 1: a multiple of rescale_every
  new = method.update(before, before.replace(step=jnp.asarray(1)), None, info)[0].sparsity
  want = [float(s) for i in range(3) for s in [v["sparsity"][f"h_{i}"]["mlp"]["fc"]["scale"]]]
  w = [v["params"][f"h_{i}"]["mlp"]["fc"]["kernel"] for i in range(3)]
  np.testing.assert_allclose(new["h"]["mlp"]["fc"]["scale"],
                             [float(s_ste.s_ste_scale(k)) for k in w], rtol=1e-6)
  assert len(set(np.round(want, 6))) == 3
