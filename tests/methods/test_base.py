"""Tests for s24jax/methods/base.py: the Method interface as the step, the model and the loop
use it.

- The step and the loop name no method (a grep of their source).
- Every built-in method trains two jitted steps with the tied head sparse; the head's stored
  mask is checked by counting its kept entries (2 of every 4; MST: zeros outside the mask).
- `dense` projects to the identity (forward and VJP compared with the inputs).
- A method's `mask` is the support of its `project` (compared with `y != 0`).
- `check_layer`: a method whose init_layer returns no 'mask', or a mask of the wrong shape or
  dtype, is refused when the model is initialised, naming the layer, the method and 'mask'.
- The 2:4 math refuses a last dimension that is not a multiple of 4, naming it.
"""
import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.nn import model as model_lib
from s24jax.training import train
from s24jax.kernels import masks
from s24jax.methods import base
from s24jax.methods import registry
from s24jax.training.run_spec import RunSpec

from tiny import tiny_config

from method_helpers import fwd_bwd, rand

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_step_and_the_loop_name_no_method():
  """No method, and no option of one, is named in the step or the loop. One exception: the
  name of the rng stream the step hands the model, 'mvue' (quoted: `rngs={"mvue": key}`),
  which is the model's API (s24jax/nn/sparse_linear.py draws the MVUE keys from it)."""
  pattern = re.compile(r"mst|decay_control|flip_monitor|act_sparsity|venom|t_sr_ste|s_ste|"
                       r"transposable|mvue")
  stream = re.compile(r"""(['"])mvue\1""")
  for name in ("train.py", "loop.py"):
    with open(os.path.join(REPO, "s24jax", "training", name)) as f:
      hits = [(i, line) for i, line in enumerate(f, 1) if pattern.search(stream.sub("", line))]
    assert not hits, (name, hits)


BUILTIN = ("dense", "ste", "sr_ste", "t_sr_ste", "s_ste", "mst")


@pytest.mark.parametrize("name", BUILTIN)
def test_every_builtin_method_trains_with_the_tied_head_sparse(name, data_cache):
  """'wte' in sparse_layers (the tied embedding / LM head) works for every built-in method:
  two jitted steps, finite losses, the head's mask stored and kept 2:4 (MST: its density)."""
  cfg = tiny_config(name, steps=4, workdir_cache=data_cache,
                    overrides={"sparsity.sparse_layers": ("*/mlp/*", "wte")})
  if name == "sr_ste":   # the masked decay reaches the head (it crashed there at step 1)
    cfg.sparsity.sr_ste.decay = 0.1
  spec = RunSpec.build(cfg)
  method = spec.method
  model = model_lib.GPT2(spec.model_cfg)
  state = spec.fresh_state(0)
  tx = spec.tx(state.params, state.sparsity)
  vocab = state.params["wte"]["embedding"].shape[0]
  batch = {"inputs": jnp.zeros((4, 16), jnp.int32) + jnp.arange(16) % vocab,
           "targets": jnp.ones((4, 16), jnp.int32)}
  for _ in range(2):
    state, metrics = train.train_step(state, batch, model=model, tx=tx)
    assert np.isfinite(float(metrics["loss"]))
  if not method.sparse:
    assert "wte" not in state.sparsity
    return
  mask = np.asarray(state.sparsity["wte"]["mask"])
  head = np.asarray(state.params["wte"]["embedding"])
  assert mask.shape == head.shape
  if method.structured_24:
    assert (mask.reshape(-1, 4).sum(1) == 2).all()
  else:   # MST: weights outside the mask are exactly 0
    assert (head[~mask] == 0).all() and 0 < mask.mean() < 1


def test_dense_is_identity():
  w = rand(0)
  y, dw, g, _ = fwd_bwd("dense", w)    # g = rand(1)
  np.testing.assert_array_equal(y, w)
  np.testing.assert_array_equal(dw, g)


def test_masks_match_forward_support():
  w = rand(5)
  for name in ("ste", "sr_ste", "s_ste"):
    proj = registry.get_method(name)
    layer = proj.init_layer(jnp.asarray(w))
    y = proj.project(jnp.asarray(w), layer)
    np.testing.assert_array_equal(np.asarray(proj.mask(jnp.asarray(w), layer)),
                                  np.asarray(y) != 0)


def test_non_multiple_of_four_names_the_dimension():
  with pytest.raises(ValueError, match="multiple of 4"):
    masks.soft_threshold24(jnp.ones((4, 6)))


# ---------------------------------------------------------------------------------------------
# check_layer: every sparse layer's state holds a bool 'mask' of the kernel's shape.


@dataclasses.dataclass(frozen=True)
class _Layered(base.Method):
  """A hard 2:4 method whose init_layer returns what `bad` says (the test's variants)."""
  bad: str = dataclasses.field(default="none", metadata=base.INTERNAL)

  def init_layer(self, kernel):
    if self.bad == "no_mask":
      return {"scale": jnp.ones((), jnp.float32)}
    if self.bad == "shape":
      return {"mask": jnp.ones(kernel.shape[::-1], bool)}
    if self.bad == "dtype":
      return {"mask": masks.nm_mask(kernel).astype(jnp.float32)}
    return super().init_layer(kernel)

  def project(self, kernel, layer):
    return jnp.where(layer["mask"], kernel, 0)


@pytest.fixture
def layered():
  names = []

  def register(bad):
    name = f"test_layered_{bad}"
    names.append(name)
    return registry.register_method(name, _Layered(bad=bad))

  try:
    yield register
  finally:
    for name in names:
      registry._REGISTRY.pop(name, None)   # pylint: disable=protected-access


def _init(method):
  cfg = tiny_config(method.name)
  model = model_lib.GPT2(model_lib.model_config(cfg, registry.from_config(cfg)))
  tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)
  return model.init(jax.random.PRNGKey(0), tokens)


def test_a_layer_state_without_a_mask_is_refused_at_model_init(layered):
  method = layered("no_mask")
  with pytest.raises(ValueError) as e:
    _init(method)
  msg = str(e.value)
  assert "'h_0/mlp/fc'" in msg                     # the first sparse layer, named
  assert f"method {method.name!r}" in msg and "'mask'" in msg
  assert "['scale']" in msg                         # what it returned instead


@pytest.mark.parametrize("bad,what", [("shape", "bool with the kernel's shape"),
                                      ("dtype", "float32")])
def test_a_mask_of_the_wrong_shape_or_dtype_is_refused_at_model_init(layered, bad, what):
  method = layered(bad)
  with pytest.raises(ValueError) as e:
    _init(method)
  msg = str(e.value)
  assert "'h_0/mlp/fc'" in msg and f"method {method.name!r}" in msg and "'mask'" in msg
  assert what in msg


def test_a_well_formed_layer_state_is_accepted(layered):
  """The same method with base's init_layer initialises, its stored masks 2:4."""
  variables = _init(layered("none"))
  mask = np.asarray(variables["sparsity"]["h_0"]["mlp"]["fc"]["mask"])
  assert mask.dtype == bool and (mask.reshape(-1, 4).sum(1) == 2).all()
