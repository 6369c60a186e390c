"""Step -> learning rate."""
from __future__ import annotations

import optax


def learning_rate(optim_cfg, total_steps: int) -> optax.Schedule:
  """Linear warm-up to `lr`, then cosine decay to `min_lr` at `total_steps` (Hu et al. 2024)."""
  warmup = max(1, min(int(optim_cfg.warmup_steps), total_steps))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=optim_cfg.lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=optim_cfg.min_lr)
