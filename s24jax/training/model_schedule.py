"""The model each step trains: the method's own phases, then dense fine-tuning.

Dense fine-tuning lives here and nowhere else: the last `sparsity.dense_finetune_fraction` of
the steps of a sparse method train its dense twin (`ModelConfig.dense_twin`: dense weights,
no activation sparsity). Hu et al. 2024 train sparse for 5/6 of the steps (fraction 1/6); the
PyTorch/xformers practice is 0.3. A method whose model changes on its own (MST's sparse
attention window) has the `ModelPhases` capability; its phase is applied first.

The loop asks `model_at(step)` before every step (one compiled step per distinct model) and
calls `enter` when the model changes.
"""
from __future__ import annotations

import flax
import jax

from s24jax import state as state_lib
from s24jax.methods import base


def dense_finetune_start(facts: base.RunFacts) -> int:
  """First step of dense fine-tuning (total_steps when there is none)."""
  return facts.total_steps - int(round(facts.dense_finetune_fraction * facts.total_steps))


def model_at(step: int, model_cfg, facts: base.RunFacts):
  """The model of `step`, from the run's model `model_cfg` (whose method is the run's)."""
  method = model_cfg.sparsity.method
  if isinstance(method, base.ModelPhases):
    model_cfg = method.model_at(step, model_cfg)
  if method.sparse and step >= dense_finetune_start(facts):
    model_cfg = model_cfg.dense_twin()
  return model_cfg


def enter(state: state_lib.TrainState, old_cfg, new_cfg) -> state_lib.TrainState:
  """The state to continue with when the model goes from `old_cfg` to `new_cfg`. Entering
  dense fine-tuning continues from the latent W (`sparsity.dense_finetune_init='latent'`, the
  reference's way: pruned weights come back) or replaces each sparse latent W by the weight
  the forward pass used, W~ ('projected': the loss is continuous at the switch). Any other
  change (an attention window) keeps the state."""
  method = old_cfg.sparsity.method
  if (new_cfg.sparsity.method.sparse or not method.sparse
      or new_cfg.sparsity.dense_finetune_init == "latent"):
    return state
  params = flax.core.unfreeze(jax.tree.map(lambda x: x, state.params))
  for path in state_lib.sparse_layer_paths(state.sparsity):
    layer = state_lib.get_path(params, path)
    name = state_lib.weight_name(layer)
    layer[name] = base.per_layer(method.project)(layer[name],
                                                 base.layer_at(state.sparsity, path))
  return state.replace(params=params)
