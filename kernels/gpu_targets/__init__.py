"""Described GPUs for deviceless XLA:GPU compilation (`kernels/aot.py`).

Each `<name>.txtpb` is a GpuTargetConfig text proto (its header names the source and the
licence). `TARGETS` maps the names the command lines accept to what the compile check needs
to know about each: the proto file, the PTX target ptxas is run with, and the tensor-core
MMA family that generation's kernels are meant to reach. No jax import here.
"""
from __future__ import annotations

import dataclasses
import pathlib

_HERE = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Target:
  name: str          # 'a100', 'h100', 'b200'
  arch: str          # PTX target / ptxas -arch
  dense_mma: str     # the dense tensor-core MMA family of this generation (PTX mnemonic)
  sparse_mma: str    # the 2:4 sparse MMA of this generation (PTX mnemonic)

  @property
  def config_path(self) -> pathlib.Path:
    return _HERE / f"{self.name}.txtpb"

  def config_text(self) -> str:
    return self.config_path.read_text()


TARGETS: dict[str, Target] = {
    "a100": Target("a100", "sm_80", "mma.sync", "mma.sp.sync"),
    "h100": Target("h100", "sm_90a", "wgmma.mma_async", "wgmma.mma_async.sp"),
    "b200": Target("b200", "sm_100a", "tcgen05.mma", "tcgen05.mma.sp"),
}


def target(name: str) -> Target:
  try:
    return TARGETS[name]
  except KeyError:
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(TARGETS)}") from None
