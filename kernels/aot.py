"""Deviceless ahead-of-time compilation for NVIDIA GPUs, on a machine without one.

XLA's own GPU compiler (in the optional CUDA plugin of requirements-gpu-aot.txt) compiles a
jitted function for a *described* GPU (a GpuTargetConfig in kernels/gpu_targets/) instead of a
device it queries. The result is a real compiled executable: optimized GPU HLO, buffer
assignment (`memory_analysis()`), and every Pallas kernel lowered to PTX and assembled by
ptxas. Nothing can run. Shared by `python -m s24jax.kernels.compile_check` and the planner.

Use, in this order (the first call must come before jax initializes a backend):

    from s24jax.kernels import aot
    aot.start(dump_dir)                      # JAX_PLATFORMS=cpu, XLA/Mosaic PTX dumps
    x = aot.spec((8192, 768), jnp.bfloat16, "h100")
    lowered, compiled = aot.compile_for_gpu(fn, x, gpu="h100")
    aot.memory_report(compiled), aot.flops(lowered)
    aot.ptx_report(ptx_files, "h100")        # ptxas -v: registers, spills, smem; MMAs

Facts this relies on (jax / jaxlib / jax-cuda13-plugin 0.10.2):
  * JAX_PLATFORMS=cpu before any backend is used: without it jax initializes the CUDA
    plugin, whose version check fails without a driver (a traceback on stderr, then CPU);
    with it the plugin's topology factory is still registered.
  * `topologies.get_topology_desc(platform="cuda", target_config=..., topology="1x1xN")`
    gives N compile-only devices on one host; `lower(lowering_platforms=("cuda",))` then
    `compile()` runs XLA:GPU's deviceless path (no autotuning: XLA's default GEMM choices).
  * `compiled.cost_analysis()` is unimplemented for these executables; XLA's cost analysis
    of the unoptimized HLO (through the CPU client) gives the FLOPs.
  * XLA_FLAGS (--xla_dump_to) and MOSAIC_GPU_DUMP_* are read once per process, so `start`
    sets them; Mosaic GPU kernels are compiled in `compile()` and registered with ptxas for
    the first target seen: compile for one GPU per process.
  * While tracing, jax.default_backend() is 'cpu': code that picks interpret mode or a
    dtype from it must be told the target (the kernels take interpret=False).
  * Which GPU a Pallas Triton kernel is lowered for: jax 0.10.2 asks for a local GPU and,
    without one, lowers for compute capability 9.0; jax 0.11.x and 0.12.x ask the abstract
    mesh's `AbstractDevice`, else the default device (here the compile-only device
    `compile_for_gpu` makes the default), and without either refuse ("No supported GPU
    devices found, please specify an abstract GPU device"). `abstract_gpu` names one, for
    lowering without the plugin (the kernels' lowering tests).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import re
import subprocess
from typing import Any, Callable, Sequence

import jax
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

from .cusparselt import library as cusparselt_library
from .gpu_targets import TARGETS, Target, target

INSTALL_HINT = "pip install -r requirements-gpu-aot.txt"


class PluginMissing(RuntimeError):
  """The optional CUDA compile plugin (or its ptxas) is not installed."""


# ---------------------------------------------------------------------------------------------
# Platform selection (before jax initializes a backend; importing jax is fine: the package
# `s24jax.kernels` imports it before this module anyway)


def nvidia_driver_present() -> bool:
  """Whether this machine has an NVIDIA driver (so a CUDA backend could start)."""
  return (os.path.exists("/proc/driver/nvidia/version")
          or any(p.name[6:].isdigit() for p in pathlib.Path("/dev").glob("nvidia*")))


def cpu_unless_gpu() -> None:
  """JAX_PLATFORMS=cpu when the user set no platform and no NVIDIA driver is present.

  With the CUDA plugin of requirements-gpu-aot.txt installed and JAX_PLATFORMS unset, every
  jax process on a machine without a GPU prints the plugin's failed CUDA version check (a
  long traceback) before falling back to the CPU. Call this before jax uses a backend
  (tests/conftest and command lines do); it changes nothing on a GPU machine or when
  JAX_PLATFORMS is set.
  """
  if "JAX_PLATFORMS" in os.environ or nvidia_driver_present():
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  jax.config.update("jax_platforms", "cpu")   # jax read JAX_PLATFORMS when it was imported


def start(dump_dir: str | os.PathLike | None = None) -> None:
  """Prepares this process for deviceless compiles; call before jax uses any backend.

  Sets JAX_PLATFORMS=cpu (required, see the module docstring) and, with `dump_dir`, makes XLA
  (Triton kernels) and Mosaic GPU write their PTX there. Raises PluginMissing with the
  install command when the CUDA plugin is absent.
  """
  os.environ["JAX_PLATFORMS"] = "cpu"
  if dump_dir is not None:
    dump_dir = str(dump_dir)
    os.makedirs(dump_dir, exist_ok=True)
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_dump_to")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_dump_to={dump_dir}"])
    # Mosaic GPU then dumps MLIR, PTX, its own ptxas -v output and SASS (with nvdisasm).
    os.environ["MOSAIC_GPU_DUMP_TO"] = dump_dir
  # A private jax module: imported here so that a release that moves it breaks this function
  # only, not `import s24jax` (which imports this module).
  from jax._src import xla_bridge   # pylint: disable=g-import-not-at-top
  if xla_bridge.backends_are_initialized():
    if jax.default_backend() != "cpu" or dump_dir is not None:
      raise RuntimeError("s24jax.kernels.aot.start() must run before jax initializes a backend "
                         "(call it first thing in the process).")
  jax.config.update("jax_platforms", "cpu")
  check_plugin()


def check_plugin() -> None:
  """Raises PluginMissing (naming the install command) without the CUDA plugin or ptxas."""
  try:   # the optional CUDA compile plugin (several GB): only its presence is checked
    import jax_plugins.xla_cuda13   # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise PluginMissing(
        "deviceless GPU compiles need XLA's CUDA compiler, which is not installed: run "
        f"`{INSTALL_HINT}` (several GB; see docs/kernels.md).") from None
  if ptxas_path() is None:
    raise PluginMissing(
        "the CUDA plugin is installed without ptxas (the nvidia-cuda-nvcc wheel of its "
        f"[with-cuda] extra): run `{INSTALL_HINT}`.")


def plugin_available() -> bool:
  try:
    check_plugin()
  except PluginMissing:
    return False
  return True


@functools.cache
def ptxas_path() -> str | None:
  """ptxas of the nvidia-cuda-nvcc wheel (the one XLA itself runs), else None."""
  try:   # the plugin's optional nvidia-cuda-nvcc wheel
    import nvidia.cu13 as cu13   # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  p = pathlib.Path(cu13.__path__[0]) / "bin" / "ptxas"
  return str(p) if p.exists() else None


# ---------------------------------------------------------------------------------------------
# Compile-only devices and compiling


@functools.cache
def devices(gpu: str, count: int = 1) -> tuple[Any, ...]:
  """`count` compile-only devices of the named GPU on one host (topology 1x1xcount)."""
  topo = topologies.get_topology_desc(
      platform="cuda", target_config=target(gpu).config_text(), topology=f"1x1x{count}")
  return tuple(topo.devices)


def mesh(gpu: str, count: int = 1, axis: str = "data"):
  """A 1-D mesh of `count` compile-only devices of the named GPU."""
  return Mesh(np.asarray(devices(gpu, count)), (axis,))


def spec(shape: Sequence[int], dtype, gpu: str, count: int = 1, partition=None):
  """An abstract input (no memory) placed on compile-only devices of the named GPU;
  replicated unless `partition` (a PartitionSpec over the mesh axis 'data') says otherwise."""
  sharding = NamedSharding(mesh(gpu, count), partition or PartitionSpec())
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract(tree, sharding):
  """ShapeDtypeStructs with `sharding` for every array leaf of `tree` (abstract or real)."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                      tree)


def compile_for_gpu(fn: Callable, *args, gpu: str, **kwargs):
  """Compiles `fn` (jitted here unless it already is) for the named GPU on abstract
  inputs. Returns (lowered, compiled)."""
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
  # Mosaic GPU kernels read the target from the default device while compiling.
  with jax.default_device(devices(gpu)[0]):
    lowered = jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    return lowered, lowered.compile()


def device_kind(gpu: str) -> str:
  """The named GPU's device kind, as jax reports it ("NVIDIA H100 80GB HBM3"): the
  `device_description_str` of its target config."""
  m = re.search(r'^device_description_str:\s*"([^"]+)"', target(gpu).config_text(), re.M)
  if m is None:
    raise ValueError(f"{target(gpu).config_path} names no device_description_str")
  return m.group(1)


@contextlib.contextmanager
def abstract_gpu(gpu: str = "h100"):
  """Lowering for the named GPU on a machine without one, and without the CUDA plugin:
  `jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))` inside this context runs
  every Pallas Triton lowering rule. Nothing is compiled (no ptxas: `compile_for_gpu` does).

  jax 0.11.x / 0.12.x read the GPU a Triton kernel is lowered for from the abstract mesh's
  `jax.sharding.AbstractDevice` (jax/_src/pallas/triton/gpu_info.py, `get_device_kind`), and
  without a GPU refuse to lower unless one is named. jax 0.10.2 ignores it and lowers for
  compute capability 9.0 whatever the GPU (its fallback without a GPU), so the same code runs
  on all three; only with jax >= 0.11 does `gpu` change the lowering. The mesh has no axes:
  it names the device and shards nothing.
  """
  device = jax.sharding.AbstractDevice(device_kind=device_kind(gpu), num_cores=None,
                                       platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                abstract_device=device)):
    yield


def memory_report(compiled) -> dict[str, int]:
  """Bytes per device from XLA's buffer assignment (exact for arguments and outputs; no
  CUDA context, library workspaces or allocator fragmentation)."""
  m = compiled.memory_analysis()
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "generated_code_size_in_bytes")
  out = {k: int(getattr(m, k)) for k in keys}
  out["total_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                        - out["alias_size_in_bytes"] + out["temp_size_in_bytes"])
  return out


def hlo_census(compiled, *, custom_call_prefix: str = cusparselt_library.PREFIX
               ) -> dict[str, int]:
  """Counts in the optimized HLO of a compiled step: the custom calls whose target starts
  with `custom_call_prefix` (inside loop bodies counted once, as written), and the
  collectives (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute)."""
  text = compiled.as_text()
  out = {"custom_calls": len(re.findall(
      rf'custom_call_target="{re.escape(custom_call_prefix)}', text))}
  for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"):
    out[op] = len(re.findall(rf"= \S+ {op}(?:-start)?\(", text))
  return out


def flops(lowered) -> float:
  """FLOPs of the unoptimized HLO (XLA's cost analysis through the CPU client; platform
  independent, counts every dot including those that become cuBLAS calls)."""
  # A private jaxlib module (renamed between releases): imported here so that a rename breaks
  # this function only, not `import s24jax`.
  from jax._src.lib import _jax   # pylint: disable=g-import-not-at-top
  hlo = lowered.compiler_ir("hlo")
  hlo = hlo.as_hlo_module() if hasattr(hlo, "as_hlo_module") else hlo
  cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, hlo)
  return float(cost.get("flops", 0.0))


# ---------------------------------------------------------------------------------------------
# PTX: tensor-core instructions and the ptxas resource report

# PTX mnemonics of the tensor-core MMAs, most specific first (a line counts once).
MMA_PATTERNS: dict[str, re.Pattern] = {
    "tcgen05.mma.sp": re.compile(r"\btcgen05\.mma\.sp\b"),
    "tcgen05.mma": re.compile(r"\btcgen05\.mma\b"),
    "wgmma.mma_async.sp": re.compile(r"\bwgmma\.mma_async\.sp\b"),
    "wgmma.mma_async": re.compile(r"\bwgmma\.mma_async\b"),
    "mma.sp.sync": re.compile(r"\bmma\.sp(?:::ordered_metadata)?\.sync\b"),
    "mma.sync": re.compile(r"\bmma\.sync\b"),
}


def mma_instructions(ptx: str) -> dict[str, int]:
  """Counts of tensor-core MMA instructions in PTX text (static occurrences, not issues)."""
  counts: dict[str, int] = {}
  for line in ptx.splitlines():
    line = line.split("//", 1)[0]
    for name, pat in MMA_PATTERNS.items():
      if pat.search(line):
        counts[name] = counts.get(name, 0) + 1
        break
  return counts


@dataclasses.dataclass
class KernelResources:
  """One kernel (PTX .entry) as ptxas -v reports it for one architecture."""
  entry: str
  arch: str
  registers: int
  spill_bytes: int           # spill stores + spill loads (bytes per thread)
  stack_bytes: int           # stack frame per thread
  smem_bytes: int            # static shared memory (dynamic smem is set at launch)
  instructions: dict[str, int]
  ptx_file: str = ""
  sass_mma: dict[str, int] | None = None   # MMA opcodes in the SASS, when it was dumped


# SASS opcodes of the tensor-core MMAs (Blackwell UTC*MMA, Hopper HGMMA, Ampere HMMA).
SASS_MMA = {"UTC*MMA": re.compile(r"\bUTC\w*MMA\b"), "HGMMA": re.compile(r"\bHGMMA\b"),
            "HMMA": re.compile(r"\bHMMA\b")}


_ENTRY = re.compile(r"\.entry\s+([\w$.]+)\s*\(")
_COMPILING = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?\b(\d+) bytes smem)?")


def ptxas_report(ptx_file: str | os.PathLike, gpu: str) -> list[KernelResources]:
  """`ptxas -v` of one PTX file for the GPU's arch; one record per entry function, with the
  tensor-core instructions found in the PTX (per file: a file's entries share them).

  Mosaic GPU dumps its own ptxas -v output (`<name>.ptxas`, its flags) and SASS beside the
  PTX; those are read when present. Otherwise the plugin's ptxas runs with XLA's defaults.
  """
  tgt: Target = target(gpu)
  ptx_file = pathlib.Path(ptx_file)
  text = ptx_file.read_text()
  own = ptx_file.with_suffix(".ptxas")
  if own.exists():
    log = own.read_text()
  else:
    exe = ptxas_path()
    if exe is None:
      raise PluginMissing(f"no ptxas: run `{INSTALL_HINT}`.")
    arch = (re.findall(r"^\.target\s+(\w+)", text, re.M) or [tgt.arch])[0]
    r = subprocess.run([exe, f"-arch={arch}", "-v", "--warn-on-spills", str(ptx_file), "-o",
                        os.devnull], capture_output=True, text=True, check=False)
    if r.returncode:
      raise RuntimeError(f"ptxas failed on {ptx_file}:\n{r.stderr[-2000:]}")
    log = r.stdout + r.stderr
  instr = mma_instructions(text)
  sass = None
  for suffix in (".sass", ".sass_ctrl"):
    if (f := ptx_file.with_suffix(suffix)).exists():
      sass_text = f.read_text()
      sass = {k: len(p.findall(sass_text)) for k, p in SASS_MMA.items()}
      sass = {k: v for k, v in sass.items() if v}
      break
  out: list[KernelResources] = []
  cur = None
  for line in log.splitlines():
    if m := _COMPILING.search(line):
      cur = KernelResources(m.group(1), m.group(2), 0, 0, 0, 0, dict(instr), str(ptx_file),
                            sass)
      out.append(cur)
    elif cur is not None and (m := _PROPS.search(line)):
      cur.stack_bytes = int(m.group(1))
      cur.spill_bytes = int(m.group(2)) + int(m.group(3))
    elif cur is not None and (m := _USED.search(line)):
      cur.registers = int(m.group(1))
      cur.smem_bytes = int(m.group(2) or 0)
  return out


def ptx_files(dump_dir: str | os.PathLike) -> list[pathlib.Path]:
  """Every non-empty PTX file below `dump_dir` (XLA's and Mosaic GPU's dumps)."""
  return sorted(p for p in pathlib.Path(dump_dir).rglob("*.ptx") if p.stat().st_size)


__all__ = [
    "INSTALL_HINT", "MMA_PATTERNS", "SASS_MMA", "KernelResources", "PluginMissing", "TARGETS",
    "abstract", "abstract_gpu", "check_plugin", "compile_for_gpu", "cpu_unless_gpu",
    "device_kind", "devices", "flops", "memory_report", "mesh", "mma_instructions",
    "nvidia_driver_present", "plugin_available", "ptx_files", "ptxas_path", "ptxas_report",
    "spec", "start",
]
