"""The train state pytree and helpers to find the sparse kernels in it.

One pytree: step, params (dense latent weights), opt_state, sparsity (per sparse layer: the
projection state such as the S-STE scale, and the mask of the last step for the flip rate),
method_state (the method's own, e.g. SR-STE's lambda_W controller, MST's update plan), rng.
Orbax saves exactly this, so a resumed run continues exactly.
"""
from __future__ import annotations

from typing import Any

import flax
import flax.struct
import jax
import numpy as np
from flax import traverse_util


@flax.struct.dataclass
class TrainState:
  step: jax.Array          # int32 scalar: optimizer steps taken
  params: Any              # float32 latent weights
  opt_state: Any
  sparsity: Any            # the model's 'sparsity' collection ({} for a dense model)
  method_state: Any        # the method's own state (methods.base.Method.init_state; {} if none)
  rng: jax.Array           # uint32[2] base key; step t uses fold_in(rng, t)


def sparse_layer_paths(sparsity: Any) -> list[tuple[str, ...]]:
  """Module paths (('h_0', 'mlp', 'fc'), ...) of the sparse layers, in a stable order."""
  flat = traverse_util.flatten_dict(flax.core.unfreeze(sparsity)) if sparsity else {}
  return sorted({k[:-1] for k in flat if k[-1] == "mask"})


def get_path(tree: Any, path: tuple[str, ...]) -> Any:
  for k in path:
    tree = tree[k]
  return tree


# The LM head's module name per model family: GPT-2's tied token embedding 'wte'
# (s24jax/nn/sparse_linear.py: SparseEmbed), Llama's untied 'lm_head' (SparseHead). Naming it in
# `sparsity.sparse_layers` makes the head a sparse layer.
HEADS = {"gpt2": "wte", "llama": "lm_head"}
HEAD = HEADS["gpt2"]


def is_head(path: tuple[str, ...]) -> bool:
  """Whether the sparse layer at `path` is an LM head (of either family)."""
  return len(path) == 1 and path[0] in HEADS.values()

# The name of a sparse layer's weight in its params: a SparseLinear's 'kernel' (out, in), or the
# tied token embedding's 'embedding' (vocab, C), which is the LM head's (out, in) weight.
WEIGHT_NAMES = ("kernel", "embedding")


def weight_name(layer_params: Any) -> str:
  """'kernel' or 'embedding': the key of the weight in one sparse layer's params."""
  for name in WEIGHT_NAMES:
    if name in layer_params:
      return name
  raise KeyError(f"a sparse layer needs one of {WEIGHT_NAMES} in its params, got "
                 f"{sorted(layer_params)}")


def sparse_weight_keys(params: Any, sparsity: Any) -> set[tuple[str, ...]]:
  """Flattened params keys of the sparse layers' weights (kernels, the tied embedding)."""
  return {p + (weight_name(get_path(params, p)),) for p in sparse_layer_paths(sparsity)}


def is_sparse_kernel(params: Any, sparsity: Any) -> Any:
  """A bool pytree shaped like params: True at the weight of every sparse layer."""
  sparse = sparse_weight_keys(params, sparsity)
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params))
  return traverse_util.unflatten_dict({k: k in sparse for k in flat})


def layer_name(path: tuple[str, ...]) -> str:
  return "/".join(path)


def with_layer_entry(sparsity: Any, name: str, values: dict[tuple[str, ...], Any]) -> Any:
  """A copy of the sparsity collection with entry `name` of the given layers replaced."""
  flat = traverse_util.flatten_dict(flax.core.unfreeze(sparsity))
  for path, value in values.items():
    flat[path + (name,)] = value
  return traverse_util.unflatten_dict(flat)


def with_masks(sparsity: Any, new_masks: dict[tuple[str, ...], jax.Array]) -> Any:
  """A copy of the sparsity collection with the 'mask' entries replaced."""
  return with_layer_entry(sparsity, "mask", new_masks)


def mask_sparse_kernels(tree: Any, sparsity: Any) -> Any:
  """Zeros every sparse layer's weight entries outside its stored 'mask' in a params-shaped
  tree (params, gradients); other leaves are returned as they are."""
  tree = flax.core.unfreeze(jax.tree.map(lambda x: x, tree))
  for path in sparse_layer_paths(sparsity):
    layer = get_path(tree, path)
    name = weight_name(layer)
    layer[name] = jax.numpy.where(get_path(sparsity, path)["mask"], layer[name], 0)
  return tree


def num_sparse_weights(params: Any, sparsity: Any) -> int:
  return sum(get_path(params, p)[weight_name(get_path(params, p))].size
             for p in sparse_layer_paths(sparsity))


def linear_kernel_shapes(params: Any) -> dict[str, tuple[int, int]]:
  """(out, in) of every linear kernel in the params ('h_0/attn/qkv' -> (3C, C)); embeddings,
  positions, norms and biases are not kernels. The stacked (L, out, in) kernels of scanned
  blocks count as (L * out, in): the same FLOPs."""
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params))
  return {"/".join(k[:-1]): (int(np.prod(v.shape[:-1])), v.shape[-1]) for k, v in flat.items()
          if k[-1] == "kernel" and len(v.shape) in (2, 3)}


def sparse_weight_shapes(params: Any, sparsity: Any) -> dict[str, tuple[int, ...]]:
  """The shape of each sparse layer's weight by layer name (linear kernels, and the tied
  head 'wte' when it is sparse)."""
  out = {}
  for p in sparse_layer_paths(sparsity):
    layer = get_path(params, p)
    out[layer_name(p)] = tuple(layer[weight_name(layer)].shape)
  return out
