"""dense: no sparsity, W~ = W. The baseline, and the twin a run switches to for dense
fine-tuning (s24jax/training/model_schedule.py switches a sparse method's model to this one then)."""
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

