"""Tiny configs and models shared by the tests (small enough for 2 CPU cores)."""
from __future__ import annotations

from s24jax.config import apply_variant, base_config


def tiny_config(method: str = "s_ste", *, steps: int = 6, workdir_cache: str | None = None,
                **overrides):
  """A 1-layer, 32-wide GPT-2 on the embedded corpus, logging/evaluating every few steps."""
  c = apply_variant(base_config(), "tiny")
  c.sparsity.method = method
  c.total_steps = steps
  c.batch_size = 4
  c.model.seq_len = 16
  c.model.num_layers, c.model.num_heads, c.model.d_model = 1, 2, 32
  c.optim.warmup_steps = 2
  c.optim.lr = 1e-2
  c.log_every = 1
  c.eval_every = steps
  c.eval_batches = 1
  c.checkpoint_every = 2
  if workdir_cache:
    c.data.cache_dir = workdir_cache
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split("__")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c
