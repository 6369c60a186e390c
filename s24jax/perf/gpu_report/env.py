"""The environment section: what ran the report (device, driver, every version, the commit)
and which libcusparseLt its process loaded, s24jax's first, then torch's (libraries.py)."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys

import jax

from s24jax.perf.gpu_report import libraries
from s24jax.kernels.cusparselt import library

# Distributions whose versions the report names (the first installed of each group).
PACKAGES = {"jax": ("jax",), "jaxlib": ("jaxlib",),
            "jax_cuda_plugin": ("jax-cuda13-plugin", "jax-cuda12-plugin"),
            "flax": ("flax",), "optax": ("optax",), "orbax_checkpoint": ("orbax-checkpoint",),
            "numpy": ("numpy",),
            "cusparselt_wheel": ("nvidia-cusparselt-cu13", "nvidia-cusparselt-cu12"),
            "cuda_runtime_wheel": ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13",
                                   "nvidia-cuda-runtime-cu12")}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _version(names) -> str | None:
  for name in names:
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      continue
  return None


def _run(cmd: list[str]) -> str:
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO)
  except (OSError, subprocess.TimeoutExpired) as e:
    return f"not run: {e}"
  return (out.stdout.strip() or out.stderr.strip())[:500]


def _cuda_version_from_smi(text: str) -> str | None:
  for part in text.split("|"):
    if "CUDA Version" in part:
      return part.split("CUDA Version:")[-1].strip()
  return None


def _torch() -> dict:
  """torch's version and whether its cuSPARSELt can run here (the GEMMs' peer; its
  cuSPARSELt's version is in `libraries`)."""
  try:
    import torch  # pylint: disable=g-import-not-at-top  (optional: the host image's peer)
  except ImportError as e:
    return {"torch": f"not importable: {e}"}
  return {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
          "torch_cuda_available": bool(torch.cuda.is_available()),
          "torch_has_cslt_sparse_mm": hasattr(torch, "_cslt_sparse_mm")}


def environment() -> dict:
  dev = jax.devices()[0]
  env = {"device": dev.device_kind, "platform": dev.platform, "device_count": jax.device_count(),
         "compute_capability": getattr(dev, "compute_capability", None),
         "python": platform.python_version(),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         **{k: _version(v) for k, v in PACKAGES.items()}}
  try:
    env["cusparselt"] = library.toolchain().cusparselt_version
  except library.Unavailable as e:
    env["cusparselt"] = f"unavailable: {str(e).splitlines()[0][:200]}"
  smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
              "--format=csv,noheader"])
  env["nvidia_smi"] = smi
  env["cuda_driver_api"] = _cuda_version_from_smi(_run(["nvidia-smi"])) if "not run" not in smi \
      else None
  # s24jax's libcusparseLt loaded first, as in the GEMMs' process, then torch's (libraries.py).
  env["libraries"] = libraries.snapshot(register=True)
  env["git_commit"] = _run(["git", "rev-parse", "--short", "HEAD"])
  env["git_dirty"] = bool(_run(["git", "status", "--porcelain", "--untracked-files=no"])) \
      if not env["git_commit"].startswith(("not run", "fatal")) else None
  env.update(_torch())
  if "torch" in sys.modules:
    env["libraries"]["torch"] = libraries.torch_side()
  return env
