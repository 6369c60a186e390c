"""The planner's report of the sparse GEMMs' kernels (`python -m s24jax.perf.plan`): per sparse layer
and GEMM, what `sparsity.gemm_choice` picks (s24jax/sparse_ops/gemm_choice.py) for the step the
planner compiles, and the time that choice is expected to save or cost against the dense GEMM,
from the times found for it (a table file, this machine's cache: nothing is measured while
planning, so a GEMM without times runs dense under 'measured').
"""
from __future__ import annotations

if __name__ == "__main__":   # before the imports: Ctrl-C while starting is one line, exit 75
  from s24jax.cli import command
  command.guard_startup("s24jax.perf.plan_gemms")

import math
from typing import Any

import jax

from s24jax import sparse_ops
from s24jax import state as state_lib


def choices(planner, micro: int) -> list[dict[str, Any]]:
  """One entry per sparse layer (layers of a scanned stack together) and GEMM of the step
  `planner` (a plan.Planner) compiles at `micro` sequences per device per micro-batch; []
  when the backend does not consult the policy."""
  sp = planner.model_cfg.sparsity
  backend = sparse_ops.get_backend(sp.backend)
  if backend.choices is None or not sp.method.sparse:
    return []
  abstract = jax.eval_shape(lambda: planner.train.fresh_state(planner.model, planner.tx_fn, 0))
  accum, seq = planner.accum_for(micro), int(planner.config.model.seq_len)
  dtype = planner.model_lib.compute_dtype(planner.config.model.dtype)
  chunk = int(planner.config.model.loss_chunk)
  full_remat = planner.config.model.remat == "full"
  rows = []
  for path in state_lib.sparse_layer_paths(abstract.sparsity):
    leaf = state_lib.get_path(abstract.params, path)
    shape = leaf[state_lib.weight_name(leaf)].shape                 # ([L,] out, in)
    layers = math.prod(shape[:-2])
    if state_lib.is_head(path):
      # No prepared W~: compressed in each call. A chunked loss calls the head once per
      # chunk of `chunk` tokens (split over the devices) and recomputes its forward.
      tokens = chunk // planner.data_parallel if chunk else micro * seq
      per_micro = micro * seq // tokens if chunk else 1
      shared, calls = 1, {"forward": 2 if chunk else 1, "dgrad": 1, "wgrad": 1}
    else:   # W~ compressed once per step; 'full' remat runs the forward twice
      tokens, per_micro, shared = micro * seq, 1, accum
      calls = {"forward": 2 if full_remat else 1, "dgrad": 1, "wgrad": 1}
    with jax.default_device(planner.target_device):
      picked = backend.choices(sp.gemm, shape[-2:], tokens, dtype, shared)
    for c in picked:
      per_call = c.saving_ms()
      n_calls = layers * accum * per_micro * calls[c.gemm]
      rows.append({"layer": "/".join(path), "layers": layers, "shape": list(shape[-2:]),
                   "tokens": tokens, "gemm": c.gemm, "sparse": c.sparse, "reason": c.reason,
                   "source": c.times.source if c.times else None,
                   "saving_ms_per_call": per_call, "calls_per_step": n_calls,
                   "saving_ms_per_step": None if per_call is None else per_call * n_calls,
                   # what the 2:4 kernel would save (negative: cost), chosen or not
                   "sparse_saving_ms_per_call": c.sparse_saving_ms()})
  return rows


def format_lines(r: dict[str, Any]) -> list[str]:
  """The report's lines for `r['gemm_choices']` (`choices`); none without entries."""
  rows = r.get("gemm_choices") or []
  if not rows:
    return []
  table = f", table {r['gemm_table']}" if r.get("gemm_table") else ""
  lines = [f"  sparse GEMMs (sparsity.gemm_choice={r['gemm_choice']!r}{table}); expected "
           "saving against the dense GEMM, from the times found (negative: a cost):"]
  for c in rows:
    kernel = "2:4 kernel" if c["sparse"] else "dense XLA"
    saving = ("no time found" if c["saving_ms_per_call"] is None else
              f"{c['saving_ms_per_call']:+.3f} ms/call x {c['calls_per_step']} = "
              f"{c['saving_ms_per_step']:+.2f} ms/step")
    if not c["sparse"] and c["sparse_saving_ms_per_call"] is not None:
      saving += f" (the 2:4 kernel: {c['sparse_saving_ms_per_call']:+.3f} ms/call)"
    lines.append(f"    {c['layer']} (x{c['layers']}, W~ {c['shape'][0]}x{c['shape'][1]}, "
                 f"{c['tokens']} tokens) {c['gemm']}: {kernel} ({c['reason']}): {saving}")
  known = [c["saving_ms_per_step"] for c in rows if c["saving_ms_per_step"] is not None]
  unknown = len(rows) - len(known)
  lines.append(f"    expected saving per optimizer step: {sum(known):+.2f} ms"
               + (f" ({unknown} chosen 2:4 GEMM(s) without times not counted)" if unknown
                  else ""))
  return lines


if __name__ == "__main__":   # a part of a tool: --help says which (not_a_command.py)
  from s24jax.perf import not_a_command
  raise SystemExit(not_a_command.answer(
      "s24jax.perf.plan_gemms", __doc__,
      "python -m s24jax.perf.plan --config experiments/X.py[:variant] "
      "[--set sparsity.backend=cusparselt]"))
