"""Plan a run before renting the GPUs: compile the configured train step for a described GPU.

    python -m s24jax.perf.plan --config experiments/gpt2_s_ste.py:1558m --gpu h100 --devices 8 \\
        [--json out.json] [--set model.remat=full ...] [--micro 8] [--no-search]

(--set parses values as every s24jax command line does: s24jax/config_files.py.)

No GPU is needed: XLA's own GPU compiler (the optional CUDA plugin of requirements-gpu-aot.txt)
compiles the real `train.train_step`, sharded over `--devices` compile-only GPUs of the
`config.mesh` shape, on abstract inputs (kernels/aot.py). The report:

  - per-device memory from XLA's buffer assignment: arguments (the state and the batch),
    outputs, aliased (donated) bytes, temporaries, total; whether the total fits the GPU
    with `--headroom` (default 10%: CUDA context, library workspaces, NCCL buffers and
    allocator fragmentation are not in XLA's figure);
  - whether XLA's own rematerialization had to recompute to fit: the step is compiled a
    second time for a copy of the GPU with 16x its memory; if the totals differ, XLA
    rematerialized to squeeze under the real limit (`xla_rematerialized`), so the real
    memory need is the larger figure and the step would run slower than planned;
  - the micro-batch (sequences per device per micro-batch), the accumulation steps and the
    global batch in tokens; model FLOPs per optimizer step, from the unoptimized HLO of the
    same step unrolled (`Planner.model_flops`: cost analysis counts a loop body once);
  - the largest micro-batch per device that fits (compiled against the 16x copy, so XLA's
    rematerialization cannot hide the need) and the accumulation that keeps the global batch.

It is also a compile-only check: a config that does not compile for the GPU fails here with
XLA's error. Exit code (s24jax/errors.py; the error path of every command,
s24jax/cli/command.py): 0 if it fits, 6 if it compiles but does not fit, 2 for a user error
(a bad argument, config file or value, every one checked before the compile plugin is looked
for; or no compile plugin; or a --json this process cannot write, or a file there that is not
a plan report), one line; 5 if the --json report could not be written after the compile (a
full disk; the report is printed first, the file left as it was; a missing folder is made);
75 Ctrl-C, one line, nothing written; 1 for an internal error (a traceback, XLA's compile
errors included).
Compile-time facts and limits: kernels/aot.py; the measured table is in docs/scaling.md.
"""
from __future__ import annotations

from s24jax.cli import command

if __name__ == "__main__":   # before the imports (jax): Ctrl-C while starting is one line
  command.guard_startup("s24jax.perf.plan")

# pylint: disable=wrong-import-position
import argparse
import dataclasses
import json
import math
import re
import sys
import time
from typing import Any

from s24jax import destinations
from s24jax import errors
from s24jax.cli import args as cli_args
from s24jax.perf import outputs
from s24jax.perf import plan_gemms
from s24jax.kernels import aot
from s24jax.kernels.cusparselt import rules as cusparselt_rules

HEADROOM = 0.10          # share of the GPU's memory kept free for what XLA does not count
BIG_MEMORY_FACTOR = 16   # the copy of the GPU used to see the memory need without XLA remat


@dataclasses.dataclass
class Compiled:
  micro: int              # sequences per device per micro-batch
  accum: int
  memory: dict[str, int]
  seconds: float
  flops: float | None = None
  hlo: dict[str, int] = dataclasses.field(default_factory=dict)   # aot.hlo_census
  # Every cuSPARSELt call of the optimized HLO, checked against the library's rules
  # (kernels/cusparselt/rules.py: audit_hlo).
  cusparselt: list = dataclasses.field(default_factory=list)


def _target_with_memory(gpu: str, factor: int) -> str:
  """The GPU's target config with device_memory_size multiplied by `factor`."""
  text = aot.target(gpu).config_text()
  size = int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))
  return re.sub(r"device_memory_size:\s*\d+", f"device_memory_size: {size * factor}", text)


def device_memory(gpu: str) -> int:
  return int(re.search(r"device_memory_size:\s*(\d+)", aot.target(gpu).config_text()).group(1))


def gpu_config(config, gpu: str):
  """The run config as it would run on the GPU: bfloat16 compute, cuDNN attention where the
  pattern allows (jax.default_backend() is the CPU while compiling here, so 'auto' cannot
  be left to decide)."""
  config = config.copy_and_resolve_references()
  if config.model.dtype == "auto":
    config.model.dtype = "bfloat16"
  if config.model.attention_impl == "auto":
    sparse_window = getattr(config.sparsity.get("mst", {}), "sparse_attention", "causal")
    uses_masks = config.model.attention != "causal" or (
        config.sparsity.method == "mst" and sparse_window != "causal")
    config.model.attention_impl = "xla" if uses_masks else "cudnn"
  del gpu
  return config


class Planner:
  """Compiles one config's train step for a GPU at any micro-batch (cached per micro-batch
  and memory size)."""

  def __init__(self, config, gpu: str, num_devices: int):
    # Imported here, after aot.start(): no JAX backend may start before it (kernels/aot.py).
    import jax   # pylint: disable=g-import-not-at-top
    from jax.experimental import topologies   # pylint: disable=g-import-not-at-top
    from s24jax.training import flops
    from s24jax.nn import model as model_lib
    from s24jax.training import run_spec
    from s24jax.training import sharding
    from s24jax.training import train   # pylint: disable=g-import-not-at-top
    self.jax, self.train, self.sharding, self.model_lib = jax, train, sharding, model_lib
    self.flops = flops
    self.config = gpu_config(config, gpu)
    self.gpu, self.num_devices = gpu, num_devices
    self.spec = run_spec.RunSpec.build(self.config)
    self.method, self.model_cfg, self.tx_fn = self.spec.method, self.spec.model_cfg, self.spec.tx
    self.model = model_lib.build(self.model_cfg)
    self._topologies = {
        factor: topologies.get_topology_desc(
            platform="cuda", target_config=_target_with_memory(gpu, factor),
            topology=f"1x1x{num_devices}")
        for factor in (1, BIG_MEMORY_FACTOR)}
    self._cache: dict[tuple[int, int], Compiled] = {}
    mesh = sharding.make_mesh(self.config.mesh, self._topologies[1].devices)
    self.data_parallel = mesh.size   # the batch splits over every device (data x fsdp)

  @property
  def target_device(self):
    """A compile-only GPU of the described kind (the step's default device while it is built)."""
    return self._topologies[1].devices[0]

  @property
  def global_batch(self) -> int:
    return int(self.config.batch_size)

  @property
  def configured_micro(self) -> int:
    return self.global_batch // int(self.config.grad_accum_steps) // self.data_parallel

  def accum_for(self, micro: int) -> int:
    return self.global_batch // (micro * self.data_parallel)

  def compile(self, micro: int, factor: int = 1, with_flops: bool = False) -> Compiled:
    """The train step at `micro` sequences per device per micro-batch."""
    key = (micro, factor)
    if key in self._cache and (self._cache[key].flops is not None or not with_flops):
      return self._cache[key]
    jax, sharding = self.jax, self.sharding
    accum = self.accum_for(micro)
    partitioner = sharding.Partitioner(
        sharding.make_mesh(self.config.mesh, self._topologies[factor].devices))
    init = lambda: self.train.fresh_state(self.model, self.tx_fn, 0)   # pylint: disable=unnecessary-lambda-assignment
    abstract_state = jax.eval_shape(init)
    shardings = partitioner.state_shardings(abstract_state)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract_state, shardings)
    tokens = jax.ShapeDtypeStruct((self.global_batch, self.config.model.seq_len), jax.numpy.int32,
                                  sharding=partitioner.batch)
    batch = {"inputs": tokens, "targets": tokens}
    start = time.time()
    with jax.default_device(self._topologies[factor].devices[0]):
      lowered = self.train.train_step.trace(
          state, batch, model=self.model, tx=self.tx_fn(abstract_state.params,
                                                        abstract_state.sparsity),
          accum_steps=accum, partitioner=partitioner).lower(lowering_platforms=("cuda",))
      compiled = lowered.compile()
    result = Compiled(micro, accum, aot.memory_report(compiled), time.time() - start,
                      self.model_flops(micro, partitioner) * accum if with_flops else None,
                      aot.hlo_census(compiled), cusparselt_rules.audit_hlo(compiled.as_text()))
    self._cache[key] = result
    return result

  def model_flops(self, micro: int, partitioner) -> float:
    """FLOPs of one micro-batch's forward + backward + update, from the unoptimized HLO of
    the same step unrolled: XLA's cost analysis counts a loop body once, so the scanned
    blocks, the accumulation scan and the chunked loss would be undercounted; remat's
    recomputation is left out (model FLOPs, not executed FLOPs). Lowered only, not compiled."""
    jax = self.jax
    # Backend 'xla': an opaque custom call (cusparselt) has no cost model; the math is the same.
    cfg = dataclasses.replace(self.model_cfg, scan_layers=False, remat="none", loss_chunk=0,
                              sparsity=dataclasses.replace(self.model_cfg.sparsity,
                                                           backend="xla"))
    model = self.model_lib.build(cfg)
    abstract_state = jax.eval_shape(lambda: self.train.fresh_state(model, self.tx_fn, 0))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract_state, partitioner.state_shardings(abstract_state))
    tokens = jax.ShapeDtypeStruct((micro * self.data_parallel, self.config.model.seq_len),
                                  jax.numpy.int32, sharding=partitioner.batch)
    with jax.default_device(self._topologies[1].devices[0]):
      lowered = self.train.train_step.trace(
          state, {"inputs": tokens, "targets": tokens}, model=model,
          tx=self.tx_fn(abstract_state.params, abstract_state.sparsity), accum_steps=1,
          partitioner=partitioner).lower(lowering_platforms=("cuda",))
    return aot.flops(lowered)

  def micro_candidates(self) -> list[int]:
    """Micro-batches per device that split the global batch evenly, smallest first."""
    per_device = self.global_batch // self.data_parallel
    return [m for m in range(1, per_device + 1) if per_device % m == 0
            and (m & (m - 1) == 0 or m == per_device)]

  def largest_fitting_micro(self, budget: int) -> int | None:
    """Binary search over the candidates, compiled against the big-memory copy (the true
    need, no XLA remat): memory grows with the micro-batch."""
    cands = self.micro_candidates()
    lo, hi, best = 0, len(cands) - 1, None
    while lo <= hi:
      mid = (lo + hi) // 2
      if self.compile(cands[mid], BIG_MEMORY_FACTOR).memory["total_bytes"] <= budget:
        best, lo = cands[mid], mid + 1
      else:
        hi = mid - 1
    return best


def plan(config, gpu: str, num_devices: int, *, micro: int | None = None,
         search: bool = True, headroom: float = HEADROOM) -> dict[str, Any]:
  """The planner's report (see the module docstring) as a dict."""
  planner = Planner(config, gpu, num_devices)
  if micro is not None:
    planner.config.grad_accum_steps = planner.accum_for(micro)
  micro = planner.configured_micro
  if micro < 1 or planner.global_batch % (micro * planner.data_parallel):
    raise ValueError(f"batch_size={planner.global_batch} with grad_accum_steps="
                     f"{planner.config.grad_accum_steps} does not split over "
                     f"{planner.data_parallel} devices")
  capacity = device_memory(gpu)
  budget = int(capacity * (1 - headroom))
  real = planner.compile(micro, 1, with_flops=True)
  big = planner.compile(micro, BIG_MEMORY_FACTOR)
  rematerialized = big.memory["total_bytes"] != real.memory["total_bytes"]
  need = max(big.memory["total_bytes"], real.memory["total_bytes"])
  report = {
      "config": planner.method.name, "gpu": gpu, "devices": num_devices,
      "mesh": {"data": planner.data_parallel // _fsdp(planner), "fsdp": _fsdp(planner)},
      "model": planner.model_cfg.describe(),
      "params": _num_params(planner),
      "micro_batch": micro, "grad_accum_steps": real.accum,
      "global_batch_sequences": planner.global_batch,
      "global_batch_tokens": planner.global_batch * planner.config.model.seq_len,
      "device_memory_bytes": capacity, "budget_bytes": budget,
      **{k: v for k, v in real.memory.items()},
      "total_bytes_per_device": real.memory["total_bytes"],
      "total_bytes_without_xla_remat": big.memory["total_bytes"],
      "xla_rematerialized": rematerialized,
      "fits": need <= budget,
      "flops_per_step": real.flops,
      "compile_seconds": real.seconds,
      # cuSPARSELt custom calls (sparsity.backend='cusparselt') and collectives in the
      # optimized HLO of the step (a loop body counted once).
      # What 2:4 GEMMs can cover: the sparse layers' share of a dense step's FLOPs.
      "family": planner.model_cfg.family,
      "sparse_gemm_flop_share": planner.flops.sparse_gemm_share(planner.spec),
      "cusparselt_custom_calls": real.hlo.get("custom_calls", 0),
      "cusparselt_calls": real.cusparselt,
      "cusparselt_rule_violations": sum(c["violation"] is not None for c in real.cusparselt),
      "collectives": {k: v for k, v in real.hlo.items() if k != "custom_calls"},
      "gemm_choice": planner.config.sparsity.gemm_choice,
      "gemm_table": planner.config.sparsity.gemm_table,
      "gemm_choices": plan_gemms.choices(planner, micro),
      "remat": planner.config.model.remat, "loss_chunk": planner.config.model.loss_chunk,
      "attention_impl": planner.config.model.attention_impl,
  }
  if search:
    best = planner.largest_fitting_micro(budget)
    report["largest_fitting_micro_batch"] = best
    report["grad_accum_steps_at_largest"] = planner.accum_for(best) if best else None
  return report


def _fsdp(planner) -> int:
  return planner.sharding.make_mesh(planner.config.mesh,
                                    planner._topologies[1].devices).shape["fsdp"]  # pylint: disable=protected-access


def _num_params(planner) -> int:
  jax = planner.jax
  shapes = jax.eval_shape(lambda: planner.train.fresh_state(planner.model, planner.tx_fn, 0))
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(shapes.params)))


def _gib(n) -> str:
  return f"{n / 2**30:.2f} GiB"


def format_report(r: dict[str, Any]) -> str:
  lines = [
      f"{r['model']} ({r['params'] / 1e6:.0f}M params) on {r['devices']} x {r['gpu']} "
      f"(mesh data={r['mesh']['data']} x fsdp={r['mesh']['fsdp']})",
      f"  global batch {r['global_batch_sequences']} sequences = "
      f"{r['global_batch_tokens']:,} tokens: micro-batch {r['micro_batch']} per device x "
      f"{r['grad_accum_steps']} accumulation steps",
      f"  remat={r['remat']} loss_chunk={r['loss_chunk']} attention={r['attention_impl']}",
      f"  per device: arguments {_gib(r['argument_size_in_bytes'])}, outputs "
      f"{_gib(r['output_size_in_bytes'])}, aliased {_gib(r['alias_size_in_bytes'])}, "
      f"temporaries {_gib(r['temp_size_in_bytes'])}",
      f"  total {_gib(r['total_bytes_per_device'])} of {_gib(r['device_memory_bytes'])} "
      f"(budget {_gib(r['budget_bytes'])} with headroom): "
      f"{'FITS' if r['fits'] else 'DOES NOT FIT'}",
      f"  XLA rematerialized to fit: {'YES (' + _gib(r['total_bytes_without_xla_remat']) + ' without)' if r['xla_rematerialized'] else 'no'}",
      f"  FLOPs per optimizer step: {r['flops_per_step']:.4g}  (compiled in "
      f"{r['compile_seconds']:.0f} s); in the sparse layers' GEMMs (what 2:4 can speed "
      f"up): {100 * r['sparse_gemm_flop_share']:.1f} % ({r['family']})",
  ]
  if r["cusparselt_custom_calls"]:
    lines.append(f"  cuSPARSELt calls: {r['cusparselt_custom_calls']}, breaking the library's "
                 f"rules: {r['cusparselt_rule_violations']}")
    lines += [f"    {c['target']}: {c['violation']}" for c in r["cusparselt_calls"]
              if c["violation"]]
  lines += plan_gemms.format_lines(r)
  if "largest_fitting_micro_batch" in r:
    best = r["largest_fitting_micro_batch"]
    lines.append(f"  largest micro-batch that fits: {best} per device"
                 + (f" (grad_accum_steps={r['grad_accum_steps_at_largest']})" if best else
                    " (none: shard more, e.g. --set mesh.fsdp=-1, or rematerialize)"))
  return "\n".join(lines)


def _headroom(text: str) -> float:
  """--headroom: a share of the GPU's memory in [0, 1)."""
  value = cli_args.number(minimum=0)(text)
  if value >= 1:
    raise argparse.ArgumentTypeError(f"{value:g} must be below 1 (a share of the GPU's memory)")
  return value


_REPORT = destinations.json_with_keys("fits", "gpu")   # what --json may replace: a plan report


def _parser() -> argparse.ArgumentParser:
  p = command.Parser(prog="python -m s24jax.perf.plan", description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, help="experiments/X.py[:variant]")
  p.add_argument("--gpu", default="h100", choices=aot.TARGETS)
  p.add_argument("--devices", type=cli_args.integer(minimum=1), default=1)
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="config override, e.g. model.remat=full (repeatable; values are "
                      "read as in s24jax/config_files.py)")
  p.add_argument("--micro", type=cli_args.integer(minimum=1), default=None,
                 help="sequences per device per micro-batch (default: the config's)")
  p.add_argument("--no-search", action="store_true", help="skip the micro-batch search")
  p.add_argument("--headroom", type=_headroom, default=HEADROOM)
  p.add_argument("--json", default=None, help="write the report here",
                 type=cli_args.output_file("a plan report", "--json", replaces=_REPORT))
  return p


def main(argv=None) -> int:
  """The planner's exit code (the module docstring)."""
  return command.run(_main, argv, name="s24jax.perf.plan")


def _main(argv) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _parser().parse_args(argv)   # the arguments, --json's place included
  from s24jax.training import validate   # pylint: disable=g-import-not-at-top (jax, the data pipeline)
  config = validate.load_config(args.config, args=args.set)
  try:
    aot.start()   # first its platform (the CPU, before check_config starts a backend) ...
    missing = None
  except aot.PluginMissing as e:
    missing = e   # ... then the plugin, said after the config's own errors
  validate.check_config(config)
  if missing is not None:
    raise errors.UserError(str(missing))
  with errors.user_errors(ValueError):   # the batch against --devices and --micro
    report = plan(config, args.gpu, args.devices, micro=args.micro,
                  search=not args.no_search, headroom=args.headroom)
  report["command"] = " ".join(["python -m s24jax.perf.plan"] + argv)
  print(format_report(report))
  if args.json:
    outputs.write(args.json, json.dumps(report, indent=2), what="the plan report",
                  replaces=_REPORT, intact="The report above is complete; the file is as it was")
  return errors.EXIT_OK if report["fits"] else errors.EXIT_DOES_NOT_FIT


if __name__ == "__main__":
  sys.exit(main())
