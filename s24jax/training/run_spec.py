"""What a run trains, built once from its config and passed on (`RunSpec.build`).

The loop, the FLOP accounting, the planner and the benchmarks all start from the same frozen
pieces: the run's facts (`RunFacts`), its method (validated and configured once, so a
method's configure warning is logged once), the frozen model config, the optimizer factory,
and the train state's shapes (traced once, abstractly, without allocating).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import ml_collections

from s24jax.nn import model as model_lib
from s24jax.training import optim
from s24jax import state as state_lib
from s24jax.training import train
from s24jax.methods import base as methods_base
from s24jax.methods import registry


@dataclasses.dataclass(frozen=True, eq=False)
class RunSpec:
  config: ml_collections.ConfigDict
  facts: methods_base.RunFacts        # what the method and the phases may know of the run
  method: methods_base.Method         # the run's method, configured
  model_cfg: model_lib.ModelConfig    # the run's model (before any phase of s24jax/training/model_schedule.py)
  abstract_state: state_lib.TrainState   # shapes and dtypes of the fresh state

  @classmethod
  def build(cls, config: ml_collections.ConfigDict) -> "RunSpec":
    facts = methods_base.RunFacts.from_config(config)
    method = registry.from_config(config, facts)
    model_cfg = model_lib.model_config(config, method)
    spec = cls(config=config, facts=facts, method=method, model_cfg=model_cfg,
               abstract_state=None)
    abstract = jax.eval_shape(lambda: spec.fresh_state(0))
    return dataclasses.replace(spec, abstract_state=abstract)

  def tx(self, params: Any, sparsity: Any):
    """The optimizer of the run, for params with these sparse layers."""
    return optim.make_optimizer(self.config, state_lib.is_sparse_kernel(params, sparsity),
                                self.method)

  @property
  def tx_fn(self) -> Callable[[Any, Any], Any]:
    return self.tx

  def fresh_state(self, seed: int | None = None) -> state_lib.TrainState:
    """A new run's state (traceable: jit it, or eval_shape it)."""
    seed = self.config.seed if seed is None else seed
    return train.fresh_state(model_lib.build(self.model_cfg), self.tx, seed)

  @property
  def kernel_shapes(self) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear kernel (state.linear_kernel_shapes)."""
    return state_lib.linear_kernel_shapes(self.abstract_state.params)

  @property
  def sparse_shapes(self) -> dict[str, tuple[int, ...]]:
    """The sparse layers' weight shapes by layer name, the tied head 'wte' included."""
    return state_lib.sparse_weight_shapes(self.abstract_state.params,
                                          self.abstract_state.sparsity)
