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
timed 3.7 % apart from it in single rounds), and its process's libcusparseLt (`libraries`,
libraries.py). The anatomy rows set `sparsity.gemm_choice` (s24jax/sparse_ops/gemm_choice.py)
to 'forward', 'forward+dgrad', 'forward+dgrad+wgrad' (cumulative: each difference is one
GEMM's cost) and 'dense' (the backend's layout and checks, no 2:4 kernel); the other
'cusparselt' rows keep the default ('measured': each GEMM sparse only where measured faster,
the measurement made at the row's first use of a shape, inside its compile time).

Variants, each cut to fit one GPU, every micro-batch 65536 tokens (as the GEMM rows'):
'124m' GPT-2 124M (64 x 1024); '1558m/2' GPT-2 1.5B's width (1600, 25 heads) cut to 2 of its
48 layers (64 x 1024); 'llama7b/2' the Llama '7b' variant (Llama 2 7B's width 4096 and FFN
11008, s24jax/training/config.py LLAMA_SIZES) cut to 2 of its 32 layers, at 32 x 2048 tokens (its
config's 64-sequence micro-batch halved). Each gives the per-layer cost of its width.

Rows run most informative first (ROWS): the Llama slice's Hu et al. pair ('xla', then
'cusparselt'; the issue judges the pair at >= 1.05x), then 124m's (on the H100, 2026-11-27,
'cusparselt' was slower: 425 ms against 294 ms) and 1.5B's, the dense steps, S-STE, and the
anatomy last. An 'xla' row followed by its 'cusparselt' pair runs only where both fit (one
alone compares nothing). A 'cusparselt' row's first use of an operand shape checks s24jax's
layout against the library on a probe of the operand's full size built on the host
(kernels/cusparselt/compression.py), which the estimate counts (`first_use_seconds`: by
layouts.py's rate, ~166 s for the Llama slice's Hu et al. operands, ~43 s for 124m's, most of
it the MVUE estimate's (N, 65536) probes), so at `--budget 420` the Llama pair is skipped for
it and 124m's runs. The 124m and 1558m/2 rows ran on an H200 on 2026-11-27 in their form of
then (one round of 5 steps, no program digest: docs/gpu_report.md); the rounds, the digests
and the Llama rows have never run on a GPU.
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
from s24jax.perf import hlo_text
from s24jax.nn import model as model_lib
from s24jax.training import run_spec
from s24jax.training import train
from s24jax.step_info import StepInfo
from s24jax.perf.gpu_report import layouts
from s24jax.perf.gpu_report import libraries
from s24jax.perf.gpu_report import rows as rows_lib
from s24jax.kernels.cusparselt import ops as cusparselt

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RECIPES = {"dense": "experiments/gpt2_dense.py", "hu2024": "experiments/gpt2_t_sr_ste_df.py",
           "s_ste": "experiments/gpt2_s_ste.py"}
LLAMA_RECIPES = {"dense": "experiments/llama_dense.py",
                 "hu2024": "experiments/llama_t_sr_ste_df.py",
                 "s_ste": "experiments/llama_s_ste.py"}
# Variant -> (config variant, extra overrides); the Llama ones take LLAMA_RECIPES.
VARIANTS = {"124m": ("124m", ()), "350m": ("350m", ()),
            "1558m/2": ("1558m", ("model.num_layers=2",)),
            "llama7b/2": ("7b", ("model.num_layers=2", "batch_size=32", "grad_accum_steps=1")),
            "tiny": ("tiny", ("model.num_layers=1", "model.d_model=64", "model.num_heads=2",
                              "model.seq_len=64", "model.vocab_size=256", "batch_size=4"))}
LLAMA_VARIANTS = ("llama7b/2",)
ANATOMY = ("forward", "forward+dgrad", "forward+dgrad+wgrad")
# (variant, recipe, backend, gemm_choice or None for the config's default), in run order.
ROWS = (("llama7b/2", "hu2024", "xla", None), ("llama7b/2", "hu2024", "cusparselt", None),
        ("124m", "hu2024", "xla", None), ("124m", "hu2024", "cusparselt", None),
        ("1558m/2", "hu2024", "xla", None), ("1558m/2", "hu2024", "cusparselt", None),
        ("llama7b/2", "dense", "xla", None), ("124m", "dense", "xla", None),
        ("1558m/2", "dense", "xla", None),
        *((v, "s_ste", b, None) for v in ("llama7b/2", "124m", "1558m/2")
          for b in ("xla", "cusparselt")),
        *(("124m", "hu2024", "cusparselt", c) for c in (*ANATOMY, "dense")),
        *(("llama7b/2", "hu2024", "cusparselt", c) for c in ANATOMY),
        *(("1558m/2", "hu2024", "cusparselt", c) for c in ANATOMY))
SMOKE_ROWS = (("tiny", "hu2024", "xla", None), ("tiny", "hu2024", "cusparselt", "forward"))
ROUNDS = 3   # timed rounds of `steps` steps per row (module docstring)
# Seconds a row takes before its first measurement (compile and warm-up), from the H100 run of
# 2026-11-27 (124m: 14-23 s a row with 10 timed steps; 'llama7b/2': a guess, ~4x 124m's
# FLOPs a step); the section then uses what it saw.
ESTIMATE = {"124m": 25.0, "350m": 45.0, "1558m/2": 30.0, "llama7b/2": 40.0, "tiny": 20.0}
# The types of each recipe's cuSPARSELt operands (layouts.TYPES): a 'cusparselt' row's first
# use of an operand shape in this process checks s24jax's layout against the library's bytes
# on a probe of the operand's full size (kernels/cusparselt/compression.py): two compiles and
# a few passes over the operand on the device per shape, by layouts.py's estimate, added to
# the row's (`first_use_seconds`).
RECIPE_TYPES = {"hu2024": ("bf16",), "s_ste": ("e4m3", "e5m2"), "dense": ()}


def first_use_seconds(variant: str, recipe: str, backend: str, checked: set) -> float:
  """The layout checks a row would run first in this process (RECIPE_TYPES), in seconds by
  layouts.py's estimate; `checked`: the (type, m, k) already checked here."""
  if backend != "cusparselt" or variant not in dict(layouts.MODELS):
    return 0.0
  cases = layouts.model_cases(variant, RECIPE_TYPES.get(recipe, ()))
  return sum(layouts.estimate_seconds(m, k, False) for d, m, k in cases
             if (d, m, k) not in checked)


def _need(row, rows_after, seen: dict, checked: set, smoke: bool) -> tuple[float, str]:
  """(seconds, why) a row needs: its variant's time, its first layout checks, and for an
  'xla' row followed by its 'cusparselt' pair, the pair's too (one alone compares nothing)."""
  variant, recipe, backend, choice = row
  first = 0.0 if smoke else first_use_seconds(variant, recipe, backend, checked)
  need, why = seen[variant] + first, ""
  if first:
    why = f", {first:.0f} s of it its first checks of s24jax's layouts (full-size probes)"
  if backend == "xla" and rows_after[:1] == [(variant, recipe, "cusparselt", choice)]:
    pair, pair_why = _need(rows_after[0], [], seen, checked, smoke)
    need, why = need + pair, f", with its 'cusparselt' pair ({pair:.0f} s{pair_why})"
  return need, why


def recipe_file(variant: str, recipe: str, recipes=None) -> str:
  """The config file of `recipe` for `variant` (`recipes`: a test's own table; a recipe not
  in the table is taken as a path)."""
  table = recipes or (LLAMA_RECIPES if variant in LLAMA_VARIANTS else RECIPES)
  return os.path.join(REPO, table[recipe]) if recipe in table else recipe


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
  program = hashlib.sha256(hlo_text.canonical(hlo_text.module_text(compiled)).encode()
                           ).hexdigest()[:12]
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
  steps = steps or (2 if smoke else 5)
  seen, checked, skipped = dict(ESTIMATE), set(), set()
  libraries.snapshot(register=True)        # s24jax's libcusparseLt loaded before anything
  rows = list(rows)
  for i, (variant, recipe, backend, choice) in enumerate(rows):
    name = f"{variant} {recipe} {backend}" + (f" gemm_choice={choice}" if choice else "")
    fields = dict(variant=variant, recipe=recipe, backend=backend, gemm_choice=choice)
    left = deadline - time.time()
    need, why = _need(rows[i], rows[i + 1:], seen, checked, smoke)
    if (variant, recipe, "xla", choice) in skipped and backend == "cusparselt":
      section.skipped(name, "budget: its 'xla' pair did not fit", **fields)
      continue
    if need > left:
      section.skipped(name, f"budget: {left:.0f} s left, the row needs about {need:.0f} s"
                      + why, **fields)
      skipped.add(rows[i])
      continue
    first_use = 0.0 if smoke else first_use_seconds(variant, recipe, backend, checked)
    config_variant, overrides = VARIANTS[variant]
    overrides = (*overrides, *([f"sparsity.gemm_choice={choice}"] if choice else []))
    path = recipe_file(variant, recipe, recipes)
    start = time.time()

    def measure(path=path, config_variant=config_variant, backend=backend,
                overrides=overrides):
      out = step_seconds(path, config_variant, backend, steps, overrides)
      return {**out, "libraries": libraries.snapshot(register=True)}

    with cusparselt.standin() if smoke else contextlib.nullcontext():
      row = section.guarded(name, measure, **fields)
    if first_use:
      checked.update(layouts.model_cases(variant, RECIPE_TYPES.get(recipe, ())))
    if row["status"] == "ok":
      seen[variant] = 1.1 * (time.time() - start - first_use)
