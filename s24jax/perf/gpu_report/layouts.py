"""The layouts section: s24jax's compressed bytes against the library's, for every (type,
shape) a train step of the report compresses, and the evidence kept where they differ.

The shapes (`cases`): per step model (steps.py's variants: GPT-2 124M's and 1.5B's FFN, Llama
7B's), per FFN matrix W~ (N, K), the three sparse operands op(A): W~ (N, K) of the forward,
W~^T (K, N) of the data gradient (TN where s24jax compresses) and the MVUE estimate (N, T) of
the weight gradient, T = STEP_TOKENS (the steps' micro-batch). Types (TYPES): bf16 (Hu et
al.: every GEMM), e4m3 for the forward and e5m2 for the weight gradient (S-STE's FP8).
First 124M's weights and the smallest MVUE estimate (the two shape classes, k the width or
the tokens), then every other weight, then the other estimates (their probes are the
largest), smallest first.

Per case: the layout s24jax writes for it on this GPU (layout.for_target; none: the library
compresses it, nothing to compare) and `compression.mismatch` against the library on a probe
operand (compression.probe_operand: two non-zeros per group at random positions, seed 0). Where
the bytes differ, the probe (`<type>_<m>x<k>_probe.npy`: op(A) as float32, which holds every
value of the type exactly) and the library's compressed bytes of it (`..._library.npy`, uint8)
go to the report's folder of files (layouts/), so the layout can be studied off the GPU
(s24jax's bytes of the probe are layout.compress(probe in its type, the layout), anywhere).

Cost: the probe is made on the device (a jitted jax.random draw) and both compressions are
compiled programs, so a case costs about its compiles (CASE_SECONDS) plus a few passes over
m k values at memory speed (PROBE_SECONDS_PER_VALUE, an allowance for a GPU: 1 ns a value);
a case that does not fit the time left is skipped. Never run on
a GPU; on a CPU (--smoke) it runs on the stand-in, which writes s24jax's layouts itself, so
the bytes agree unless a test makes them differ.
"""
from __future__ import annotations

import contextlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from s24jax.perf.gpu_report import libraries
from s24jax.perf.gpu_report import rows as rows_lib
from s24jax.kernels.cusparselt import compression
from s24jax.kernels.cusparselt import layout
from s24jax.kernels.cusparselt import ops as cusparselt

STEP_TOKENS = 65536
# (step variant, FFN matrices W~ (N, K)), most informative first; s24jax/training/config.py's sizes.
MODELS = (("124m", ((3072, 768), (768, 3072))), ("llama7b/2", ((11008, 4096), (4096, 11008))),
          ("1558m/2", ((6400, 1600), (1600, 6400))))
SMOKE_MODELS = (("tiny", ((256, 64), (64, 256))),)
# First: 124M's weights and the smallest estimate (the other shape class: k = T), each type.
FIRST_WEIGHTS = ((3072, 768), (768, 3072), (256, 64), (64, 256))
SMOKE_TOKENS = 256
# Which types each GEMM's A takes in the steps: Hu et al.'s in bf16; S-STE's forward in e4m3
# and its weight gradient in e5m2 (its mask is not transposable: its dX is dense).
TYPES = {"forward": ("bf16", "e4m3"), "dgrad": ("bf16",), "wgrad": ("bf16", "e5m2")}
DTYPES = {"bf16": jnp.bfloat16, "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
CASE_SECONDS = 1.0                 # two small compiles and the comparison
PROBE_SECONDS_PER_VALUE = 1e-9     # the device's probe and copies (module docstring)
FOLDER = "layouts"


def compute_capability(smoke: bool) -> tuple[int, int] | None:
  """The GPU whose layouts s24jax writes: the stand-in's with --smoke, else the first device's
  (None off a GPU)."""
  if smoke:
    return cusparselt.STANDIN_COMPUTE_CAPABILITY
  cc = getattr(jax.devices()[0], "compute_capability", None)
  try:
    return tuple(int(p) for p in str(cc).split(".")[:2]) if cc else None
  except ValueError:
    return None


def cases(smoke: bool) -> list[tuple[str, int, int, list[str]]]:
  """[(type, m, k, [what uses it])] in the order they run (module docstring)."""
  tokens = SMOKE_TOKENS if smoke else STEP_TOKENS
  found: dict[tuple[str, int, int], list[str]] = {}
  weights, estimates = [], []
  for model, matrices in SMOKE_MODELS if smoke else MODELS:
    for n, k in matrices:
      for kind, (m_, k_) in (("forward", (n, k)), ("dgrad", (k, n)), ("wgrad", (n, tokens))):
        for dtype in TYPES[kind]:
          key = (dtype, m_, k_)
          if key not in found:
            found[key] = []
            (estimates if kind == "wgrad" else weights).append(key)
          found[key].append(f"{model} W~ {n}x{k} {kind}")
  estimates.sort(key=lambda c: c[1] * c[2])
  first = [c for c in weights if c[1:] in FIRST_WEIGHTS] + [
      c for c in estimates if c[1:] == estimates[0][1:]]
  order = first + [c for c in weights + estimates if c not in first]
  return [(*key, found[key]) for key in order]


def estimate_seconds(m: int, k: int, smoke: bool) -> float:
  return CASE_SECONDS + (0.0 if smoke else PROBE_SECONDS_PER_VALUE * m * k)


def model_cases(model: str, dtype_names: tuple[str, ...]) -> list[tuple[str, int, int]]:
  """The (type, m, k) of `model`'s sparse operands in the types given: what a 'cusparselt'
  step of it checks at its first use (steps.py's estimate)."""
  return [(d, m, k) for d, m, k, used_by in cases(False)
          if d in dtype_names and any(u.startswith(f"{model} ") for u in used_by)]


def dump(files: str, dtype_name: str, gemm: cusparselt.Gemm) -> list[str]:
  """Writes the probe of `gemm`'s A and the library's compressed bytes of it (module
  docstring); their paths."""
  dtype = DTYPES[dtype_name]
  probe = compression.probe_operand(gemm.m, gemm.k, dtype)
  d_dtype = jnp.float32 if jnp.dtype(dtype).itemsize == 1 else dtype   # as mismatch asks
  theirs = jax.jit(lambda x: cusparselt.compress(x, gemm, b_dtype=dtype, d_dtype=d_dtype))(
      jnp.asarray(probe))
  folder = os.path.join(files, FOLDER)
  os.makedirs(folder, exist_ok=True)
  base = os.path.join(folder, f"{dtype_name}_{gemm.m}x{gemm.k}")
  paths = [base + "_probe.npy", base + "_library.npy"]
  np.save(paths[0], np.asarray(probe, np.float32))   # NumPy cannot load bf16 / FP8 .npy
  np.save(paths[1], np.asarray(theirs))
  return paths


def check(dtype_name: str, m: int, k: int, smoke: bool, files: str) -> dict:
  """One case's fields: the layout, the verdict (None: the same bytes), the files written."""
  dtype = DTYPES[dtype_name]
  lay = layout.for_target(compute_capability(smoke), jnp.dtype(dtype).itemsize, m, k)
  out = {"layout": lay.name if lay else None, "verified_layout": lay.verified if lay else None,
         "mismatch": None, "files": []}
  if lay is None:
    out["note"] = "no s24jax layout for this type and shape on this GPU: the library compresses"
    return out
  gemm = cusparselt.Gemm(m=m, n=256, k=k, trans_a=True, trans_b=False)   # n: any (compress2)
  out["mismatch"] = compression.mismatch(gemm, dtype, lay)
  if out["mismatch"] is not None:
    try:
      out["files"] = [os.path.relpath(p, os.path.dirname(files))
                      for p in dump(files, dtype_name, gemm)]
    except Exception as e:  # pylint: disable=broad-except  (the verdict stands; say why)
      out["dump_error"] = rows_lib.error_line(e)
  return out


def run(section: rows_lib.Section, deadline: float, smoke: bool, files: str) -> None:
  """Every case of `cases`, each recorded as it ends; one that cannot finish before
  `deadline` is recorded as skipped."""
  libraries.snapshot(register=True)        # s24jax's libcusparseLt loaded before anything
  for dtype_name, m, k, used_by in cases(smoke):
    name = f"{dtype_name} ({m}, {k})"
    fields = dict(dtype=dtype_name, m=m, k=k, used_by=used_by)
    left, need = deadline - time.time(), estimate_seconds(m, k, smoke)
    if need > left:
      section.skipped(name, f"budget: {left:.0f} s left, the case needs about {need:.0f} s",
                      **fields)
      continue
    with cusparselt.standin() if smoke else contextlib.nullcontext():
      section.guarded(name, lambda d=dtype_name, m=m, k=k: {
          **check(d, m, k, smoke, files), "libraries": libraries.snapshot(register=True)},
          **fields)
