"""The kernels a compiled step launches, from its optimized HLO text: what each costs and why
it is there.

`census(text)` lists every kernel one execution of the module launches (`Kernel`):

  * a top-level fusion, custom call (cuBLAS / cuBLASLt GEMMs, cuDNN attention, the
    cuSPARSELt FFI calls `cusparselt_*`), copy, transpose or any other op that is not
    bookkeeping (parameter, tuple, get-tuple-element, bitcast, constant, ...), once;
  * the kernels of a while loop's body, times the loop's trip count (XLA's
    `known_trip_count`; the gradient-accumulation scan, the scanned layers, the chunked loss),
    and of a called computation, at the caller's count. A loop with a known trip count runs
    its body only (XLA:GPU does not evaluate the condition); without one the census counts
    the body once and says so (`Kernel.trips_known`);
  * each branch of a conditional, marked with the branch (`Kernel.branch`): the census cannot
    know which branch a step takes (T-SR-STE refreshes its masks every 40 steps in one).

Each kernel carries FLOPs (dots and convolutions 2*M*N*K from their shapes, batch dimensions
included; every other op one per output element, a reduction one per input element; a
custom call's from its shapes: GEMMs as dots, cuDNN flash attention 4*B*H*Sq*Sk*D forward
and 2.5x that backward, halved for a causal mask; cuSPARSELt's spmm as the dense product it
computes) and bytes (its operands and outputs, where a fused dynamic-slice reads only its
slice and a fused in-place dynamic-update-slice or scatter writes only its update: XLA:GPU's
own accounting), and a category (CATEGORIES) from what it is and where it comes from: the
custom-call target, the op names (`jit(train_step)/.../mlp/fc/...`) and the Python stack
frames XLA keeps per instruction (the HLO text's StackFrames table: s24jax's functions by
file and name; `SOURCES`). A fusion holding work of several categories counts once, in the
first that matches (`category`: e.g. an FP8 amax fused into a gradient sum is FP8's).

Pure text processing (s24jax/perf/hlo_text.py parses): no JAX, no compile. `python -m
s24jax.perf.step_time census` compiles a step (the planner's path) and prints the table;
tests/perf/test_step_census.py checks the census on hand-written HLO and on compiled scans.
"""
from __future__ import annotations

if __name__ == "__main__":   # before the imports: Ctrl-C while starting is one line, exit 75
  from s24jax.cli import command
  command.guard_startup("s24jax.perf.step_census")

import collections
import dataclasses
import math
import re
from typing import Iterable

from s24jax.perf.hlo_text import (Computation, Instr, Module, arrays, callees, elements,
                              ffi_attributes, int_list, is_fp8, known_trip_count, nbytes,
                              parse)

# Categories, in the order tables list them.
DENSE_GEMM = "dense GEMM"
SPARSE_GEMM = "sparse GEMM"
COMPRESSION = "2:4 compression"
MVUE = "MVUE estimate"
FP8 = "FP8 quantization"
MASK_SEARCH = "transposable-mask search"
METHOD = "2:4 projection / method"
TRANSPOSE = "transpose / copy"
ATTENTION = "attention"
OPTIMIZER = "optimizer"
OTHER = "other"
CATEGORIES = (DENSE_GEMM, SPARSE_GEMM, COMPRESSION, MVUE, FP8, MASK_SEARCH, METHOD, TRANSPOSE,
              ATTENTION, OPTIMIZER, OTHER)

# Where a kernel's work comes from, first match wins: (category, named scopes, functions,
# files). A kernel matches when any instruction it holds has one of the `jax.named_scope`
# names as a component of its op name, or one of the functions or files in its Python stack
# frames (a function by its qualified name, its last component or a prefix of it:
# `TSRSTE.refresh.<locals>.fresh` matches `TSRSTE.refresh`). A custom_vjp's backward rule keeps
# its caller's frames and name stack, not its own, so inside the sparse GEMMs' backward only
# named scopes (or a jit's name, as `_gumbel` in the MVUE draw) tell the work apart:
# the library names them where the work is done (`@jax.named_scope` on masks.mvue24,
# masks.transposable_mask, fp8.quantize and sparse_ops.common.fp8_scale).
SOURCES: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...] = (
    (MVUE, ("mvue", "_gumbel"), ("mvue24", "_mvue24_weights", "_inclusion_prob_grouped",
                                 "_mvue_key", "mvue24_inclusion_prob"),
     ("kernels/mvue24.py",)),
    (MASK_SEARCH, ("transposable_mask",), ("transposable_mask", "transposable_mask24",
                                           "transposable_kept_ratio", "TSRSTE.refresh"),
     ("kernels/transposable_mask.py",)),
    (FP8, ("fp8_quantize",), ("quantize", "amax_scale", "scale_from_amax", "fp8_scale"),
     ("s24jax/sparse_ops/fp8.py",)),
    (COMPRESSION, ("cusparselt_prepare", "cusparselt_s24jax_compress"), (),
     ("kernels/cusparselt/",)),
    (METHOD, (), (), ("s24jax/methods/", "kernels/masks.py", "kernels/sparsify24.py",
                      "s24jax/methods/flip_monitor.py")),
    (OPTIMIZER, ("optimizer",), (), ("/optax/", "s24jax/training/optim.py")),
    (ATTENTION, ("dot_product_attention", "attend"), ("attend",),
     ("s24jax/methods/mst/attention_masks.py",)),
)
# Ops that launch nothing: bookkeeping, or the second half of an async pair.
NOT_KERNELS = frozenset((
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "iota-free",
    "copy-done", "all-reduce-done", "all-gather-done", "collective-permute-done", "send-done",
    "recv-done", "async-done", "async-update"))
# Ops counted one FLOP per input element (the rest: per output element, data movement none).
REDUCTIONS = frozenset(("reduce", "reduce-window", "reduce-precision", "select-and-scatter"))
MOVES = frozenset(("copy", "transpose", "bitcast", "reshape", "broadcast", "slice",
                   "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "gather",
                   "scatter", "get-tuple-element", "tuple", "parameter", "constant", "iota",
                   "reverse", "copy-start", "bitcast-convert", "convert"))
GEMM_CUSTOM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


@dataclasses.dataclass
class Kernel:
  """One kernel of the step, `count` launches per execution of the module."""
  name: str
  opcode: str                   # fusion, custom-call, copy, ...
  target: str                   # custom-call target or fusion kind ('' for others)
  category: str
  count: int
  flops: float                  # per launch
  bytes: float                  # per launch
  op_name: str
  fp8_gemm: bool = False        # a GEMM with 8-bit float operands
  gemm_mnk: tuple[int, int, int] | None = None   # a custom-call GEMM's (M, N, K), batch in M
  branch: str = ""              # "cond.8:true": only on the steps taking that branch
  trips_known: bool = True
  operand_bytes: float = 0.0    # per launch, the operands alone
  # An FFI custom call's attributes (its backend config `{m = 3072 : i64, a_dtype = "bf16"}`
  # as strings: {"m": "3072", "a_dtype": "bf16"}).
  attributes: dict[str, str] = dataclasses.field(default_factory=dict)


class _Walk:
  """Walks a parsed module's computations and lists its kernels (the module docstring)."""

  def __init__(self, module: Module):
    self.m = module
    self.kernels: list[Kernel] = []

  def walk(self, comp_name: str, count: int, branch: str = "", trips_known: bool = True):
    comp = self.m.computations[comp_name]
    for instr in comp.instrs.values():
      op = instr.opcode
      if op in NOT_KERNELS:
        continue
      if op == "while":
        trips = known_trip_count(instr.attrs)
        self.walk(callees(instr.attrs, ("body",))[0], count * (trips or 1), branch,
                  trips_known and trips is not None)
        if trips is None:   # the condition runs too, at least once (not counted further)
          self.walk(callees(instr.attrs, ("condition",))[0], count, branch, False)
        continue
      if op == "conditional":
        named = [("true", c) for c in callees(instr.attrs, ("true_computation",))]
        named += [("false", c) for c in callees(instr.attrs, ("false_computation",))]
        named += [(str(i), c) for i, c in
                  enumerate(callees(instr.attrs, ("branch_computations",)))]
        for label, callee in named:
          self.walk(callee, count, f"{instr.name}:{label}", trips_known)
        continue
      if op == "call":
        for callee in callees(instr.attrs, ("to_apply",)):
          self.walk(callee, count, branch, trips_known)
        continue
      self.kernels.append(self.kernel(instr, comp, count, branch, trips_known))

  # -- one kernel --------------------------------------------------------------------------

  def _type_of(self, comp: Computation, name: str) -> str:
    instr = comp.instrs.get(name)
    return instr.type if instr is not None else ""

  def _fused(self, comp_name: str) -> list[tuple[Instr, Computation]]:
    """The instructions of a fused computation, nested fusions included."""
    comp = self.m.computations.get(comp_name)
    if comp is None:
      return []
    out = []
    for instr in comp.instrs.values():
      out.append((instr, comp))
      for callee in callees(instr.attrs, ("calls",)):
        out.extend(self._fused(callee))
    return out

  def _flops(self, instrs: list[tuple[Instr, Computation]]) -> float:
    total = 0.0
    for instr, comp in instrs:
      if instr.opcode == "dot":
        lhs = arrays(self._type_of(comp, instr.operands[0]))
        k = math.prod(lhs[0][1][d] for d in int_list(instr.attrs, "lhs_contracting_dims"))
        total += 2.0 * elements(instr.type) * k
      elif instr.opcode == "convolution":
        # 2 x output elements x kernel elements / output features (the GEMM-like ones XLA
        # emits: feature dimension last in the kernel)
        kernel, out = arrays(self._type_of(comp, instr.operands[1])), arrays(instr.type)
        if kernel and out:
          total += 2.0 * elements(instr.type) * math.prod(kernel[0][1]) / max(
              kernel[0][1][-1], 1)
      elif instr.opcode in REDUCTIONS:
        total += elements(self._type_of(comp, instr.operands[0])) if instr.operands else 0
      elif instr.opcode not in MOVES and instr.opcode != "fusion":
        total += elements(instr.type)
    return total

  def _fusion_bytes(self, instr: Instr, caller: Computation, comp: Computation) -> float:
    """Operands and outputs of a fusion; a parameter that is only sliced reads its slices,
    one that an in-place dynamic-update-slice or scatter updates is not read, and that
    update writes only its slice (XLA:GPU's accounting)."""
    params = {int(p.args): p.name for p in comp.instrs.values()
              if p.opcode == "parameter" and p.args.isdigit()}
    users = collections.defaultdict(list)
    for u in comp.instrs.values():
      for o in u.operands:
        users[o].append(u)
    total = 0.0
    for i, operand in enumerate(instr.operands):
      full = nbytes(self._type_of(caller, operand))
      uses = users.get(params.get(i, ""), [])
      if uses and all(u.opcode in ("dynamic-slice", "slice", "gather")
                      and u.operands[0] == params[i] for u in uses):
        total += min(full, sum(nbytes(u.type) for u in uses))
      elif uses and all(u.opcode in ("dynamic-update-slice", "scatter")
                        and u.operands[0] == params[i] for u in uses):
        continue    # updated in place: the write is its update, counted with the output
      else:
        total += full
    return total + self._written(comp, comp.root)

  def _written(self, comp: Computation, name: str) -> float:
    instr = comp.instrs[name]
    if instr.opcode == "tuple":
      return sum(self._written(comp, o) for o in instr.operands)
    if instr.opcode == "bitcast" and instr.operands and instr.operands[0] in comp.instrs:
      return self._written(comp, instr.operands[0])
    if instr.opcode == "dynamic-update-slice":
      return nbytes(self._type_of(comp, instr.operands[1]))
    if instr.opcode == "scatter":   # in place: the updates (the operands after the indices)
      half = (len(instr.operands) - 1) // 2
      return sum(nbytes(self._type_of(comp, o)) for o in instr.operands[1 + half:])
    return nbytes(instr.type)

  def kernel(self, instr: Instr, comp: Computation, count: int, branch: str,
             trips_known: bool) -> Kernel:
    operands_bytes = sum(nbytes(self._type_of(comp, o)) for o in instr.operands)
    target, mnk, fp8 = "", None, False
    if instr.opcode == "fusion":
      callee = callees(instr.attrs, ("calls",))[0]
      inner = self._fused(callee)
      kind = re.search(r'"kind":"([^"]+)"', instr.attrs) or re.search(r"kind=(\w+)",
                                                                        instr.attrs)
      target = kind.group(1) if kind else ""
      flops = self._flops(inner)
      nbytes_ = self._fusion_bytes(instr, comp, self.m.computations[callee])
      dots = [(i, c) for i, c in inner if i.opcode in ("dot", "convolution")]
      fp8 = any(is_fp8(self._type_of(c, o)) for i, c in dots for o in i.operands)
    elif instr.opcode == "custom-call":
      target = re.search(r'custom_call_target="([^"]+)"', instr.attrs).group(1)
      inner = [(instr, comp)]
      flops, mnk = self._custom_call_flops(instr, comp, target)
      nbytes_ = operands_bytes + nbytes(instr.type)
      dots = [(instr, comp)] if mnk else []
      fp8 = bool(mnk) and any(is_fp8(self._type_of(comp, o)) for o in instr.operands[:2])
    else:
      inner = [(instr, comp)]
      flops = self._flops(inner)
      dots = [(instr, comp)] if instr.opcode in ("dot", "convolution") else []
      if instr.opcode == "dynamic-update-slice":
        nbytes_ = 2 * nbytes(self._type_of(comp, instr.operands[1]))
      elif instr.opcode in ("dynamic-slice", "slice"):
        nbytes_ = 2 * nbytes(instr.type)
      else:
        nbytes_ = operands_bytes + nbytes(instr.type)
    return Kernel(instr.name, instr.opcode, target,
                  self.category(instr, inner, dots, target), count, flops, nbytes_,
                  instr.op_name, fp8_gemm=fp8 and bool(dots), gemm_mnk=mnk, branch=branch,
                  trips_known=trips_known, operand_bytes=operands_bytes,
                  attributes=ffi_attributes(instr.attrs) if instr.opcode == "custom-call"
                  else {})

  def _custom_call_flops(self, instr: Instr, comp: Computation, target: str):
    """(FLOPs, (M, N, K) of a GEMM or None) of a custom call, from its shapes."""
    out = arrays(instr.type)
    ins = [arrays(self._type_of(comp, o)) for o in instr.operands]
    if target.startswith("cusparselt_spmm"):
      config = ffi_attributes(instr.attrs)
      if all(config.get(key, "").isdigit() for key in ("m", "n", "k")):
        m, n, k = (int(config[key]) for key in ("m", "n", "k"))
        return 2.0 * m * n * k, (m, n, k)
      return 0.0, None
    if target in GEMM_CUSTOM_CALLS and out and ins and ins[0]:
      k = math.prod(ins[0][0][1][d]
                    for d in int_list(instr.attrs, "lhs_contracting_dimensions"))
      batch = math.prod(ins[0][0][1][d]
                        for d in int_list(instr.attrs, "lhs_batch_dimensions"))
      m = math.prod(ins[0][0][1]) // max(k * batch, 1)
      n = math.prod(out[0][1]) // max(m * batch, 1)
      return 2.0 * batch * m * n * k, (batch * m, n, k)
    if target.startswith("__cudnn$fmha") and ins and ins[0]:
      # 4 B H Sq Sk D forward (two GEMMs); backward 2.5x (five); causal: half the blocks.
      scores = _intermediate_shape(instr.attrs)                 # (B, H, Sq, Sk)
      d = ins[0][0][1][-1]
      forward = 4.0 * math.prod(scores) * d if scores else 0.0
      causal = re.search(r'"mask_type":\s*"CAUSAL', instr.attrs) is not None
      return forward * (2.5 if "Backward" in target else 1.0) * (0.5 if causal else 1.0), None
    return 0.0, None

  # -- categories --------------------------------------------------------------------------

  def _sources(self, instrs: Iterable[Instr]) -> str | None:
    """The first SOURCES category any of the instructions comes from."""
    instrs = list(instrs)
    for category, scopes, functions, files in SOURCES:
      for instr in instrs:
        if any(f"/{scope}/" in f"/{instr.op_name}/" or f"/jit({scope})/" in f"/{instr.op_name}/"
               for scope in scopes):
          return category
        for file, function in self.m.frame_chain(instr.frame):
          if any(f in file for f in files) or any(
              function == fn or function.startswith(fn + ".") or function.endswith("." + fn)
              for fn in functions):
            return category
    return None

  def _optimizer(self, instr: Instr) -> bool:
    """Work of train_step itself, outside the loss and the model: the optimizer update and
    the step's bookkeeping (gradient norm, metrics). A fusion carries its root's frame."""
    chain = self.m.frame_chain(instr.frame)
    return bool(chain) and chain[0][1] == "train_step" and chain[0][0].endswith(
        "s24jax/training/train.py")

  def category(self, instr: Instr, inner: list[tuple[Instr, Computation]], dots, target: str
               ) -> str:
    """In this order: the custom-call target; a GEMM (dense unless its dot is the mask
    search's or attention's); data movement alone; SOURCES; FP8 outputs; the optimizer;
    other."""
    if target.startswith("cusparselt_spmm"):
      return SPARSE_GEMM
    if target.startswith("cusparselt_compress"):
      return COMPRESSION
    if target.startswith("__cudnn$fmha"):
      return ATTENTION
    if dots:   # a GEMM: where its dot comes from (the mask search has one), else dense
      source = self._sources(i for i, _ in dots)
      return source if source in (MASK_SEARCH, ATTENTION) else DENSE_GEMM
    body = [i for i, _ in inner if i.opcode != "parameter"]
    # Data movement alone (a layout change around a custom call, dY^T for the MVUE
    # estimate, W~^T for an FP8 GEMM): a transpose or copy whatever it serves.
    if instr.opcode in ("copy", "transpose", "copy-start") or (
        instr.opcode == "fusion" and body and
        all(i.opcode in ("copy", "transpose", "bitcast", "reshape") for i in body)):
      return TRANSPOSE
    source = self._sources(body)
    if source is not None:
      return source
    if any(is_fp8(i.type) for i in body):
      return FP8
    if self._optimizer(instr):
      return OPTIMIZER
    return OTHER


def _intermediate_shape(attrs: str) -> tuple[int, ...]:
  """The (B, H, Sq, Sk) score tensor of a cuDNN attention call (its backend config)."""
  m = re.search(r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*"dimensions":'
                r'\s*\[([^\]]*)\]', attrs)
  return tuple(int(d.strip(' "')) for d in m.group(1).split(",") if d.strip(' "')) if m else ()


def census(text: str) -> list[Kernel]:
  """Every kernel one execution of the module launches (the module docstring)."""
  module = parse(text)
  walk = _Walk(module)
  walk.walk(module.entry, 1)
  return walk.kernels


@dataclasses.dataclass
class Row:
  """A category's kernels per step."""
  launches: int = 0
  flops: float = 0.0
  bytes: float = 0.0


def summarize(kernels: Iterable[Kernel], *, branches: str = "exclude") -> dict[str, Row]:
  """Per category: launches, FLOPs and bytes per step. Kernels of conditional branches are
  left out (`branches='exclude'`: the common step) or counted (`'include'`)."""
  rows = {c: Row() for c in CATEGORIES}
  for k in kernels:
    if k.branch and branches == "exclude":
      continue
    r = rows[k.category]
    r.launches += k.count
    r.flops += k.count * k.flops
    r.bytes += k.count * k.bytes
  return rows


if __name__ == "__main__":   # a part of a tool: --help says which (not_a_command.py)
  from s24jax.perf import not_a_command
  raise SystemExit(not_a_command.answer(
      "s24jax.perf.step_census", __doc__,
      "python -m s24jax.perf.step_time census "
      "(--config experiments/X.py[:variant] | --hlo FILE_OR_DUMP_DIR)"))
