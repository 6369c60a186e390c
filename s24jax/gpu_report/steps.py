"""The train-step section: dense / Hu et al. / S-STE with sparsity.backend 'xla' and
'cusparselt', and the step's anatomy on 'cusparselt' (which of its GEMMs run on 2:4 kernels).

One device, one micro-batch per step (the config's micro-batch, grad_accum_steps=1, bf16), on
random tokens: XLA's compiled memory, then 2 warm-up steps and ROUNDS rounds of `steps` steps
dispatched back to back (the host queues them; one wait per round); the step time is the
median round's mean, and the rounds are recorded (their spread: the timing's noise). Each row
also records its `program`: a digest of the optimized HLO without names and source positions
(hlo_text.canonical): rows with the same program run the same kernels, so a difference in
their times is noise (on the H200, 2026-11-27, a 'cusparselt' step whose GEMMs were all
measured slower, which compiles to the 'xla' program (tests/sparse_ops/test_gemm_choice.py),
timed 3.7 % apart from it in single rounds). The
anatomy rows set `sparsity.gemm_choice` (s24jax/sparse_ops/gemm_choice.py) to 'forward',
'forward+dgrad', 'forward+dgrad+wgrad' (cumulative: each difference is one GEMM's cost) and
'dense' (the backend's layout and checks, no 2:4 kernel); the plain 'cusparselt' row keeps
the default ('measured'). Variant '1558m/2' is GPT-2 1.5B's width (1600, 25 heads) cut to 2
of its 48 layers: the per-layer cost of the widest model on one GPU.

Rows run most informative first (ROWS): the 124m Hu et al. step on both backends and its
anatomy (on the H100, 2026-11-27, 'cusparselt' was slower: 425 ms against 294 ms), then the
1.5B width, S-STE, and 350m.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from s24jax import config_files
from s24jax import hlo_text
from s24jax import model as model_lib
from s24jax import run_spec
from s24jax import train
from s24jax.step_info import StepInfo
from s24jax.gpu_report import rows as rows_lib
from s24jax.kernels.cusparselt import ops as cusparselt

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = {"dense": "experiments/gpt2_dense.py", "hu2024": "experiments/gpt2_t_sr_ste_df.py",
           "s_ste": "experiments/gpt2_s_ste.py"}
# Variant -> (config variant, extra overrides).
VARIANTS = {"124m": ("124m", ()), "350m": ("350m", ()),
            "1558m/2": ("1558m", ("model.num_layers=2",)),
            "tiny": ("tiny", ("model.num_layers=1", "model.d_model=64", "model.num_heads=2",
                              "model.seq_len=64", "model.vocab_size=256", "batch_size=4"))}
ANATOMY = ("forward", "forward+dgrad", "forward+dgrad+wgrad")
# (variant, recipe, backend, gemm_choice or None for the config's default), in run order.
ROWS = (("124m", "hu2024", "xla", None), ("124m", "hu2024", "cusparselt", None),
        *(("124m", "hu2024", "cusparselt", c) for c in ANATOMY),
        ("124m", "dense", "xla", None),
        ("1558m/2", "hu2024", "xla", None), ("1558m/2", "hu2024", "cusparselt", ANATOMY[-1]),
        ("1558m/2", "dense", "xla", None),
        ("124m", "s_ste", "xla", None), ("124m", "s_ste", "cusparselt", None),
        ("124m", "hu2024", "cusparselt", "dense"),
        *(("1558m/2", "hu2024", "cusparselt", c) for c in ANATOMY[:-1]),
        ("350m", "dense", "xla", None), ("350m", "hu2024", "xla", None),
        ("350m", "hu2024", "cusparselt", None), ("350m", "s_ste", "xla", None),
        ("350m", "s_ste", "cusparselt", None))
SMOKE_ROWS = (("tiny", "hu2024", "xla", None), ("tiny", "hu2024", "cusparselt", "forward"))
ROUNDS = 3   # timed rounds of `steps` steps per row (module docstring)
# Seconds a row takes before its first measurement (compile and warm-up), from the H100 run of
# 2026-11-27 (124m: 14-23 s a row with 10 timed steps); the section then uses what it saw.
ESTIMATE = {"124m": 25.0, "350m": 45.0, "1558m/2": 30.0, "tiny": 20.0}


def step_seconds(path: str, variant: str, backend: str, steps: int, overrides=()) -> dict:
  """One device, one micro-batch per step (module docstring): the step's time and memory."""
  probe = config_files.load_config(f"{path}:{variant}", args=overrides)
  micro = int(probe.batch_size) // int(probe.grad_accum_steps)
  config = config_files.load_config(
      f"{path}:{variant}", args=[*overrides, f"sparsity.backend={backend}",
                                 f"batch_size={micro}", "grad_accum_steps=1",
                                 "model.dtype=bfloat16"])
  spec = run_spec.RunSpec.build(config)
  model = model_lib.build(spec.model_cfg)
  state = jax.jit(lambda: spec.fresh_state(0))()
  tx = spec.tx(state.params, state.sparsity)
  tokens = jnp.asarray(np.random.default_rng(0).integers(
      0, spec.model_cfg.vocab_size, (micro, spec.model_cfg.seq_len)), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens}
  # A step the loop does not log (most steps; the log step adds the flip-rate and mask
  # metrics): its StepInfo is traced, so the logged branch is compiled but not run.
  # (its own step array: the state's is donated to the step)
  info = StepInfo(step=jnp.array(state.step), log=jnp.asarray(False))
  start = time.perf_counter()
  compiled = train.train_step.lower(state, batch, info, model=model, tx=tx).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
           - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  program = hashlib.sha256(hlo_text.canonical(compiled.as_text()).encode()).hexdigest()[:12]
  for _ in range(2):
    state, metrics = compiled(state, batch, info)
  jax.block_until_ready(metrics["loss"])
  rounds = []
  for _ in range(ROUNDS):
    start = time.perf_counter()
    for _ in range(steps):                  # queued back to back; one wait
      state, metrics = compiled(state, batch, info)
    jax.block_until_ready(metrics["loss"])
    rounds.append((time.perf_counter() - start) / steps)
  seconds = float(np.median(rounds))
  return {"micro_batch": micro, "layers": int(spec.model_cfg.num_layers),
          "d_model": int(spec.model_cfg.d_model), "step_ms": 1e3 * seconds,
          "step_ms_rounds": [round(1e3 * r, 2) for r in rounds],
          "tokens_per_sec": micro * spec.model_cfg.seq_len / seconds,
          "compiled_gib_per_device": total / 2**30, "compile_s": compile_s,
          "program": program, "final_loss": float(metrics["loss"] / metrics["count"])}


def run(section: rows_lib.Section, deadline: float, smoke: bool, *, rows=None,
        recipes=None, steps: int | None = None) -> None:
  """Every row (ROWS; SMOKE_ROWS with --smoke) recorded as it ends; a row that cannot
  finish before `deadline` is recorded as skipped, a failing one with its error."""
  rows = rows if rows is not None else (SMOKE_ROWS if smoke else ROWS)
  recipes = recipes or RECIPES
  steps = steps or (2 if smoke else 5)
  seen = dict(ESTIMATE)
  for variant, recipe, backend, choice in rows:
    name = f"{variant} {recipe} {backend}" + (f" gemm_choice={choice}" if choice else "")
    fields = dict(variant=variant, recipe=recipe, backend=backend, gemm_choice=choice)
    left = deadline - time.time()
    if seen[variant] > left:
      section.skipped(name, f"budget: {left:.0f} s left, the row needs about "
                      f"{seen[variant]:.0f} s", **fields)
      continue
    config_variant, overrides = VARIANTS[variant]
    overrides = (*overrides, *([f"sparsity.gemm_choice={choice}"] if choice else []))
    path = os.path.join(REPO, recipes[recipe]) if recipe in recipes else recipe
    start = time.time()
    with cusparselt.standin() if smoke else contextlib.nullcontext():
      row = section.guarded(name, lambda: step_seconds(path, config_variant, backend, steps,
                                                       overrides), **fields)
    if row["status"] == "ok":
      seen[variant] = 1.1 * (time.time() - start)
