"""Equal recompute: under one remat policy (s24jax/nn/layers.py, REMAT_POLICIES) a dense block and
a sparse one keep the same activations for the backward pass.

A sparse layer's GEMMs sit inside the op's custom_vjp (and a cuSPARSELt call is no dot), so
the dot-based 'save_dots' policy used to keep only the dense layers' outputs: the sparse
recipes recomputed what dense stored. Every linear layer's output is now named
(sparse_linear.LINEAR_OUTPUT) and kept by name. The reference is the block's architecture:
the output of each linear layer that the backward reads (qkv (B, T, 3C), out (B, T, C), fc
(B, T, 4C); not proj's, which only enters the residual sum), in the compute dtype, and
nothing else but the arguments. Before the names, the sparse blocks kept no FFN output.
"""
import contextlib
import io
import re

import jax
import jax.numpy as jnp
import pytest

from s24jax.nn import layers
from s24jax.nn import model as model_lib
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.training.run_spec import RunSpec

from tiny import tiny_config

B, T, C = 2, 16, 32   # tiny_config: width 32, 16 positions

RECIPES = {
    "dense": ("dense", {}),
    "hu2024 xla": ("t_sr_ste", {"sparsity.mvue": True}),
    "s_ste xla": ("s_ste", {"sparsity.mvue": True}),
    "hu2024 cusparselt": ("t_sr_ste", {"sparsity.mvue": True, "sparsity.backend": "cusparselt",
                                       "sparsity.gemm_choice": "sparse"}),
    "s_ste cusparselt": ("s_ste", {"sparsity.mvue": True, "sparsity.backend": "cusparselt",
                                   "sparsity.gemm_choice": "sparse"}),
}


def saved(recipe: str, remat: str) -> list[tuple[tuple[int, ...], str]]:
  """(shape, dtype) of each residual a Block keeps under the policy `remat`, but its
  arguments (the parameters and the input)."""
  method, overrides = RECIPES[recipe]
  cfg = tiny_config(method, overrides={"model.dtype": "bfloat16", **overrides})
  block = model_lib.Block(RunSpec.build(cfg).model_cfg)
  x = jax.random.normal(jax.random.key(0), (B, T, C), jnp.bfloat16)
  variables = block.init(jax.random.key(1), x)
  params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}

  def loss(params, x):
    y = block.apply({"params": params, **rest}, x, rngs={"mvue": jax.random.key(2)})
    return jnp.sum(y.astype(jnp.float32))

  f = jax.checkpoint(loss, policy=layers.REMAT_POLICIES[remat])
  out = io.StringIO()
  with cusparselt.standin(), contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(f, params, x)   # one 'bf16[2,16,96] why' a line
  lines = out.getvalue().splitlines()
  parsed = [re.match(r"(\w+)\[([\d,]*)\] (.*)", line) for line in lines]
  assert all(parsed), lines
  return sorted((tuple(int(d) for d in m[2].split(",") if d), m[1]) for m in parsed
                if not m[3].startswith("from the argument"))


# The linear outputs the backward reads: qkv (attention's input), out (with the block input,
# the residual stream that ln_2 normalizes) and fc (the activation's input); proj's output
# only enters the residual sum, whose derivative needs no value.
LINEAR_OUTPUTS = sorted([((B, T, 3 * C), "bf16"), ((B, T, C), "bf16"), ((B, T, 4 * C), "bf16")])


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_save_dots_keeps_every_linear_output_dense_or_sparse(recipe):
  assert saved(recipe, "save_dots") == LINEAR_OUTPUTS


@pytest.mark.parametrize("recipe", ["dense", "hu2024 cusparselt"])
def test_full_remat_keeps_only_the_arguments(recipe):
  assert saved(recipe, "full") == []
