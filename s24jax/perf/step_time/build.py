"""Compiling a train step for the census: the GPU report's step on one compile-only GPU, the
planner's path (s24jax/perf/plan.py)."""
from __future__ import annotations

import gzip
import hashlib
import json
import pathlib
import sys

from s24jax import destinations
from s24jax import errors
from s24jax.perf import hlo_text
from s24jax.perf import step_census
from s24jax.kernels import aot

REPO = pathlib.Path(__file__).resolve().parents[3]


def step_config(spec: str, backend: str, overrides=(), micro: int | None = None):
  """The config as the GPU report times it (module docstring)."""
  from s24jax.training import validate   # pylint: disable=g-import-not-at-top (jax)
  probe = validate.load_config(spec, args=list(overrides))
  micro = micro or int(probe.batch_size) // int(probe.grad_accum_steps)
  extra = [f"sparsity.backend={backend}", f"batch_size={micro}", "grad_accum_steps=1",
           "model.dtype=bfloat16", "mesh.data=1", "mesh.fsdp=1"]
  if ("gemm_choice" in probe.sparsity and backend == "cusparselt"
      and not any(o.startswith("sparsity.gemm_choice=") for o in overrides)):
    extra.append("sparsity.gemm_choice=sparse")   # every GEMM on 2:4, as on 2026-11-27
  config = validate.load_config(spec, args=[*overrides, *extra])
  validate.check_fields(config)
  return config


# Sources that do not change a compiled step (the census and the model themselves).
NOT_IN_STEP = ("s24jax/perf/hlo_text.py", "s24jax/perf/step_census.py", "s24jax/perf/roofline.py",
               "s24jax/perf/step_time/")


def source_digest(step: bool = True) -> str:
  """A digest of the library's source (s24jax/, kernels/) that compiles a step (step=True: a
  cached HLO is this code's), or of the census and the model (NOT_IN_STEP; step=False)."""
  h = hashlib.sha256()
  for folder in ("s24jax", "kernels"):
    for p in sorted((REPO / folder).rglob("*.py")):
      if str(p.relative_to(REPO)).startswith(NOT_IN_STEP) == step:
        continue
      h.update(str(p.relative_to(REPO)).encode())
      h.update(p.read_bytes())
  return h.hexdigest()[:16]


def compile_step(config, gpu: str = "h100", cache: str | None = None) -> tuple[str, dict]:
  """(optimized HLO text, XLA's memory report) of the config's train step, one device, a
  step the loop does not log (the GPU report's since e59f2a7)."""
  import jax   # pylint: disable=g-import-not-at-top (after aot.start)
  key = hashlib.sha256(json.dumps([config.to_json(), gpu, jax.__version__, source_digest(),
                                   "unlogged step"]).encode()).hexdigest()[:24]
  path = pathlib.Path(cache) / f"{key}.json.gz" if cache else None
  if path is not None and path.exists():
    try:
      saved = json.loads(gzip.decompress(path.read_bytes()))
      return saved["hlo"], saved["memory"]
    except (OSError, EOFError, ValueError, KeyError, TypeError):
      pass   # a damaged entry of the cache (only ours): compiled again and replaced
  # A persistent compilation cache keys executables without their metadata: one compiled
  # before the named scopes would come back with the op names of then. (Off for this
  # compile only: a test process keeps its own.)
  was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    compiled = _compile(config, gpu)
  finally:
    jax.config.update("jax_enable_compilation_cache", was)
  hlo, memory = compiled.as_text(), aot.memory_report(compiled)
  if path is not None:
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      destinations.write_atomic(str(path), gzip.compress(
          json.dumps({"hlo": hlo, "memory": memory}).encode()))
    except OSError as e:   # the cache only saves time: the compile's result is still used
      if not destinations.is_write_error(e, under=str(path.parent)):
        raise
      print(f"s24jax.perf.step_time: warning: the compile was not cached in {cache}: "
            f"{destinations.reason(e)}", file=sys.stderr)
  return hlo, memory


def _compile(config, gpu: str):
  import jax   # pylint: disable=g-import-not-at-top (after aot.start)
  from s24jax.perf import plan   # pylint: disable=g-import-not-at-top (a tool: jax, the plugin)
  from s24jax.step_info import StepInfo   # pylint: disable=g-import-not-at-top (jax)
  planner = plan.Planner(config, gpu, 1)
  devices = planner._topologies[plan.BIG_MEMORY_FACTOR].devices   # pylint: disable=protected-access
  partitioner = planner.sharding.Partitioner(planner.sharding.make_mesh(config.mesh, devices))
  abstract = jax.eval_shape(lambda: planner.train.fresh_state(planner.model, planner.tx_fn, 0))
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       abstract, partitioner.state_shardings(abstract))
  tokens = jax.ShapeDtypeStruct((planner.global_batch, config.model.seq_len), jax.numpy.int32,
                                sharding=partitioner.batch)
  # A step the loop does not log, as the GPU report times it (s24jax/perf/gpu_report/steps.py): a
  # traced StepInfo, so the log step's metrics are a conditional branch the census leaves out.
  info = StepInfo(step=state.step, log=jax.ShapeDtypeStruct((), bool,
                                                            sharding=state.step.sharding))
  with jax.default_device(devices[0]):
    lowered = planner.train.train_step.trace(
        state, {"inputs": tokens, "targets": tokens}, info, model=planner.model,
        tx=planner.tx_fn(abstract.params, abstract.sparsity), accum_steps=1,
        partitioner=partitioner).lower(lowering_platforms=("cuda",))
    return lowered.compile()


def compile_census(spec: str, backend: str, overrides, micro, gpu: str = "h100", cache=None):
  """(config, its step's kernels (step_census), XLA's memory report)."""
  config = step_config(spec, backend, overrides, micro)
  hlo, memory = compile_step(config, gpu, cache)
  return config, step_census.census(hlo), memory


def read_hlo(path: str) -> str:
  """HLO text from a file, or the after-optimizations dump of jit_train_step in a folder."""
  p = pathlib.Path(path)
  if p.is_dir():
    dumps = sorted(p.glob("*jit_train_step*after_optimizations.txt"))
    if not dumps:
      raise errors.UserError(f"--hlo {path}: no *jit_train_step*after_optimizations.txt in it "
                             "(dump with XLA_FLAGS=--xla_dump_to=DIR)")
    p = dumps[0]
  if not p.is_file():
    raise errors.UserError(f"--hlo {path}: no such file or folder")
  try:
    return p.read_bytes().decode("utf-8")
  except OSError as e:
    raise errors.UserError(f"--hlo {p}: cannot be read ({e.strerror})") from None
  except UnicodeDecodeError:
    raise errors.UserError(f"--hlo {p}: not text (a binary file?): give optimized HLO text, "
                           "e.g. an XLA dump's *after_optimizations.txt") from None


def hlo_census(path: str) -> list[step_census.Kernel]:
  """The kernels of the HLO text at `path` (read_hlo); UserError where it is not HLO text."""
  text = read_hlo(path)
  try:
    return step_census.census(text)
  except hlo_text.NotHlo as e:
    raise errors.UserError(f"--hlo {path}: not optimized HLO text: {e} (give an XLA dump's "
                           "*after_optimizations.txt, or its folder)") from None
