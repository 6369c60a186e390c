"""Step -> value schedules: learning rate, sparse/dense phase."""
from __future__ import annotations

import optax


def learning_rate(optim_cfg, total_steps: int) -> optax.Schedule:
  """Linear warm-up to `lr`, then cosine decay to `min_lr` at `total_steps` (Hu et al. 2024)."""
  warmup = max(1, min(int(optim_cfg.warmup_steps), total_steps))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=optim_cfg.lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=optim_cfg.min_lr)


def dense_finetune_start(total_steps: int, fraction: float) -> int:
  """First step of the dense fine-tuning phase (total_steps when there is none).

  Hu et al. 2024 train sparse for 5/6 of the steps (GPT-2: 250k of 300k), fraction = 1/6.
  """
  return total_steps - int(round(fraction * total_steps))


def phase(step: int, total_steps: int, fraction: float) -> str:
  """'sparse' or 'dense' at `step`."""
  return "dense" if step >= dense_finetune_start(total_steps, fraction) else "sparse"
