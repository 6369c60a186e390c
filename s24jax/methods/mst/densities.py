"""MST's layer sparsities (host side, float64 as in the reference): the reference's layer
order, Erdos-Renyi and uniform distributions, and the sparse layers' shapes."""
from __future__ import annotations

import re
from typing import Any, Mapping

from s24jax import state as state_lib
from s24jax.methods import base

DISTRIBUTIONS = ("erdos_renyi", "uniform")
Shapes = Mapping[str, tuple[int, int]]

_BLOCK_ORDER = ("attn/qkv", "attn/out", "mlp/fc", "mlp/proj")


def reference_order(names) -> list[str]:
  """Layer names in the reference's order (its module registration order): per block
  qkv, out, fc, proj, blocks in order, then the tied head 'wte'. The Erdos-Renyi sums run in
  this order, so the floats (and the counts truncated from them) are the reference's."""
  def key(name):
    match = re.fullmatch(r"h_(\d+)/(.+)", name)
    if match:
      rest = match.group(2)
      pos = _BLOCK_ORDER.index(rest) if rest in _BLOCK_ORDER else len(_BLOCK_ORDER)
      return (0, int(match.group(1)), pos, rest)
    return (2 if state_lib.is_head((name,)) else 1, 0, 0, name)
  return sorted(names, key=key)


def erdos_renyi_sparsities(shapes: Shapes, sparsity: float) -> dict[str, float]:
  """Per-layer sparsity S_l of a global `sparsity`, Erdos-Renyi, in the reference's float
  arithmetic (`shapes` in reference order, (out, in) each).

  raw_l = (out + in) / (out in). eps = (sum_{l not dense} N_l (1 - s) - sum_{l dense} N_l s)
  / sum_{l not dense} raw_l N_l; while the largest raw_l among the others has eps raw_l > 1,
  every layer with that raw value becomes dense and eps is solved again. S_l = 1 - eps raw_l
  (0 for dense layers).
  """
  dense: set[str] = set()
  while True:
    rhs, divisor, raw = 0.0, 0.0, {}
    for name, (o, i) in shapes.items():
      n = int(o) * int(i)
      if name in dense:
        rhs -= n * sparsity
      else:
        rhs += n * (1 - sparsity)
        raw[name] = (int(o) + int(i)) / n
        divisor += raw[name] * n
    if not raw:
      raise ValueError(f"no Erdos-Renyi layer sparsities reach global sparsity {sparsity}")
    eps = rhs / divisor
    top = max(raw.values())
    if top * eps > 1:
      dense |= {name for name, r in raw.items() if r == top}
      continue
    return {name: 0.0 if name in dense else 1 - raw[name] * eps for name in shapes}


def layer_sparsities(shapes: Shapes, sparsity: float,
                     distribution: str = "erdos_renyi") -> dict[str, float]:
  """Per-layer sparsities of a global `sparsity` under `distribution` (DISTRIBUTIONS)."""
  if distribution == "erdos_renyi":
    return erdos_renyi_sparsities(shapes, sparsity)
  if distribution == "uniform":
    return {k: float(sparsity) for k in shapes}
  raise ValueError(f"unknown mst.distribution {distribution!r}; valid: {', '.join(DISTRIBUTIONS)}")


def layer_shapes(params: Any, sparsity: Any) -> dict[str, tuple[int, int]]:
  """(out, in) of every sparse layer ('wte': (vocab, C)), by name, in reference order."""
  shapes = {state_lib.layer_name(p): tuple(base.kernel_at(params, p).shape)
            for p in state_lib.sparse_layer_paths(sparsity)}
  return {k: shapes[k] for k in reference_order(shapes)}
