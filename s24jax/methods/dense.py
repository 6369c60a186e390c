"""dense: no sparsity, W~ = W. The baseline, and the twin a run switches to for dense
fine-tuning (every method's `model_at` returns a model with this method then)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from s24jax.methods import base


@dataclasses.dataclass(frozen=True)
class Dense(base.Method):
  sparse: ClassVar[bool] = False

  def project(self, kernel, layer):
    del layer
    return kernel

  def after_update(self, params, sparsity, step):
    del step
    return params, sparsity, {}

  def model_at(self, step, model_cfg, config):
    del step, config
    return model_cfg


base.register_method("dense", Dense())
