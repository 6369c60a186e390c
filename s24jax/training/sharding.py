"""Data parallelism and ZeRO-3-style sharded state, on JAX's own sharding.

The mesh is 2-D, ('data', 'fsdp'), sized by `config.mesh.data` and `config.mesh.fsdp` (-1: all
the remaining devices; the default, data=-1 and fsdp=1, is pure data parallelism). The batch
is split over both axes. Parameters, optimizer state and the per-layer sparsity state are
sharded along 'fsdp' by the named rules below (every leaf of the train state whose path
matches a rule and whose chosen dimension divides evenly), and replicated along 'data'; XLA
inserts the all-gathers before use and the reduce-scatters of the gradients. With fsdp = 1
every rule resolves to "replicated" and the step is plain data parallelism.

Rules are matched against a leaf's path ('params/h_0/mlp/fc/kernel',
'opt_state/1/0/mu/h_0/mlp/fc/kernel', 'sparsity/h_0/mlp/fc/mask'), first match wins:
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp")
# (pattern over the leaf path, the dimension sharded along 'fsdp', counted from the end).
# Kernels are (out, in), or (L, out, in) for scanned blocks: sharding `out` keeps every 2:4
# group (along `in`) whole on one device, so masks and projections need no communication, and
# keeps each scanned layer split over all devices. The vocabulary rows of the embedding, the
# positions of the position table. Everything else (biases, norms, scales) is replicated.
RULES: tuple[tuple[str, int], ...] = (
    (r"(^|/)kernel$", -2),
    (r"(^|/)(mask|plain_mask|refresh_mask)$", -2),
    (r"(^|/)embedding$", -2),
    (r"(^|/)wpe$", -2),
)


def mesh_shape(num_devices: int, data: int = -1, fsdp: int = 1) -> tuple[int, int]:
  """(data, fsdp) for `num_devices`, resolving one -1 to the remaining devices."""
  if data == -1 and fsdp == -1:
    raise ValueError("at most one of mesh.data and mesh.fsdp may be -1")
  if data == -1:
    data = num_devices // fsdp if fsdp > 0 and num_devices % fsdp == 0 else 0
  elif fsdp == -1:
    fsdp = num_devices // data if data > 0 and num_devices % data == 0 else 0
  if data < 1 or fsdp < 1 or data * fsdp != num_devices:
    raise ValueError(f"mesh.data x mesh.fsdp must use the {num_devices} devices exactly "
                     f"(-1: the rest); got data={data}, fsdp={fsdp}")
  return data, fsdp


def make_mesh(mesh_cfg=None, devices=None) -> Mesh:
  """The ('data', 'fsdp') mesh over `devices` (default: every device of every host)."""
  devices = np.asarray(devices if devices is not None else jax.devices()).reshape(-1)
  data = int(getattr(mesh_cfg, "data", -1)) if mesh_cfg is not None else -1
  fsdp = int(getattr(mesh_cfg, "fsdp", 1)) if mesh_cfg is not None else 1
  return Mesh(devices.reshape(mesh_shape(devices.size, data, fsdp)), AXES)


def path_str(path) -> str:
  """'params/h_0/mlp/fc/kernel' from a jax key path."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
  return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class Partitioner:
  """Where every leaf of the train state and every batch lives (hashable: a jit static arg)."""
  mesh: Mesh

  @property
  def fsdp(self) -> int:
    return self.mesh.shape["fsdp"]

  def spec(self, path: str, shape: tuple[int, ...]) -> P:
    """The partition spec of a leaf: the first matching rule's dimension on 'fsdp' if it
    divides evenly, else replicated."""
    if self.fsdp > 1:
      for pattern, dim in RULES:
        if re.search(pattern, path):
          if len(shape) >= -dim and shape[dim] % self.fsdp == 0:
            return P(*([None] * (len(shape) + dim) + ["fsdp"]))
          break
    return P()

  def state_shardings(self, state: Any) -> Any:
    """NamedShardings shaped like `state` (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(self.mesh, self.spec(path_str(p), tuple(x.shape))), state)

  def constrain(self, state: Any) -> Any:
    """Inside jit: pins every leaf of a new state to its sharding (so the donated buffers are
    reused and the state stays sharded step after step)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, self.spec(path_str(p), tuple(x.shape)))), state)

  @property
  def batch(self) -> NamedSharding:
    """Batch rows split over both mesh axes."""
    return NamedSharding(self.mesh, P(AXES))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())


def bytes_per_device(tree: Any) -> int:
  """Bytes of `tree`'s arrays held by one (the first local) device."""
  device = jax.local_devices()[0]
  total = 0
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      if shard.device == device:
        total += shard.data.nbytes
  return total
