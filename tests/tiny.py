"""Tiny configs shared by the tests (small enough for 2 CPU cores)."""
from __future__ import annotations

from typing import Any, Mapping

from s24jax import config_files
from s24jax.training.config import apply_variant
from s24jax.training.config import base_config


def tiny_config(method: str = "s_ste", *, steps: int = 6, workdir_cache: str | None = None,
                overrides: Mapping[str, Any] | None = None):
  """A 1-layer, 32-wide GPT-2 on the embedded corpus, logging/evaluating every few steps.
  `overrides` ({'sparsity.mvue': True, ...}) are set as the command line sets them
  (s24jax/config_files.py: type-checked, an unknown field is an error)."""
  c = apply_variant(base_config(), "tiny")
  c.sparsity.method = method
  c.total_steps = steps
  c.batch_size = 4
  c.model.seq_len = 16
  c.model.num_layers, c.model.num_heads, c.model.d_model = 1, 2, 32
  # float32 on every platform ('auto' is bfloat16 on a GPU): the tests compare these models
  # against float32 / float64 references, at float32 tolerances.
  c.model.dtype = "float32"
  c.optim.warmup_steps = 2
  c.optim.lr = 1e-2
  c.log_every = 1
  c.eval_every = steps
  c.eval_batches = 1
  c.checkpoint_every = 2
  if workdir_cache:
    c.data.cache_dir = workdir_cache
  return config_files.apply_overrides(c, overrides or {})
