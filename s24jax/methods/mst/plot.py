"""The plot of MST's Sparsity Variation schedule (mst_schedule.png in the workdir)."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from s24jax.methods.mst.schedule import (PHASES, attention_at, attention_window, drop_fraction,
                                         phase_bounds, target_sparsity)


def schedule_series(m, total: int, steps: Sequence[int] | None = None
                    ) -> dict[str, np.ndarray]:
  """step, target sparsity, drop fraction and sparse-attention flag on a grid of steps."""
  if steps is None:
    steps = np.unique(np.linspace(0, max(total - 1, 0), min(total, 2000)).astype(int))
  return {
      "step": np.asarray(steps),
      "sparsity": np.asarray([target_sparsity(m, s, total) for s in steps]),
      "drop_fraction": np.asarray([drop_fraction(m, s, total) for s in steps]),
      "sparse_attention": np.asarray([attention_at(m, s, total, "causal") != "causal"
                                      for s in steps]),
  }


def plot_schedule(m, total_steps: int, attention_stride: int, png_path: str, *,
                  measured: Mapping[str, Sequence[float]] | None = None) -> str:
  """PNG of the Sparsity Variation schedule: target sparsity per phase, drop fraction, the
  sparse-attention window, and (optional) `measured` {'step': [...], 'sparsity': [...]}."""
  # Imported here: matplotlib takes seconds to import and only the end-of-run plot needs it.
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top  (no pyplot state)

  s = schedule_series(m, total_steps)
  fig = Figure(figsize=(8, 4))
  ax = fig.subplots()
  ax.plot(s["step"], s["sparsity"], "k-", lw=2, label="target sparsity")
  ax.plot(s["step"], s["drop_fraction"], "b--", lw=1, label="drop fraction $\\zeta_t$")
  if measured is not None and len(measured.get("step", ())):
    ax.plot(measured["step"], measured["sparsity"], "ro", ms=3, label="after each update")
  for (start, end), name, color in zip(phase_bounds(m, total_steps), PHASES,
                                       ("#fde0c5", "#f5b7b1", "#d5f5e3")):
    ax.axvspan(start, end, color=color, alpha=0.5, lw=0)
    ax.text((start + end) / 2, 1.02, name, ha="center", va="bottom", fontsize=8)
  a0, a1 = attention_window(m, total_steps)
  if a1 > a0:
    ax.axvspan(a0, a1, ymin=0, ymax=0.04, color="purple", alpha=0.6, lw=0,
               label=f"sparse attention ({m.sparse_attention}, "
                     f"l={attention_stride})")
  ax.set_ylim(0, 1.1)
  ax.set_xlabel("step"), ax.set_ylabel("fraction")
  ax.legend(fontsize=8, loc="center right")
  ax.set_title(f"MST Sparsity Variation ({m.schedule})")
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  return png_path
