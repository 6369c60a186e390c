"""Compile every kernel for a GPU, without one: `python -m s24jax.kernels.compile_check --gpu h100`.

For one GPU (a100: sm_80, h100: sm_90a, b200: sm_100a) it compiles each kernel of this
package, forward and (where it has one) backward, through XLA's own GPU compiler against the
GPU's target config (kernels/aot.py, kernels/gpu_targets/) at the GPT-2 FFN shapes from 124M to
1.5B: d in {768, 1024, 1280, 1600}, hidden 4d, bf16, token counts 64..16384. Each Pallas
kernel's PTX is assembled again by the plugin's ptxas with -v, and the check prints one row
per kernel and shape: registers, shared memory (static + what the launch reserves), spill
bytes, the tensor-core instructions in its PTX, and whether they include the one the kernel is
meant to use (`expect`; "-" for the memory-bound kernels, which use none).

It exits non-zero on any compile failure, any spill, or a kernel without the MMA it is meant
to use. `--json PATH` writes one record per kernel and shape (kernel, shape, ok, registers,
spill_bytes, smem_bytes, instructions, expected, ...). `--quick` compiles the corner shapes
only (d 768 and 1600, tokens 64 and 16384). Needs `pip install -r requirements-gpu-aot.txt`;
compiles for one GPU per process (Mosaic GPU registers the first target it sees).

What shape means per kernel: weights are (out, in) = (4d, d) for the first FFN matmul and
(d, 4d) for the second; `T` is the token count; the weight-only kernels (sparsify24,
transposable_mask24) do not depend on T and are compiled once per weight.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import pathlib
import re
import shutil
import sys
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp

from . import aot
from . import tcgen05
from ._common import meta_words
from .compressed_matmul import sparse24_matmul
from .gated_activation import gated_act
from .gpu_targets import target
from .mvue24 import mvue24_compress
from .sparsify24 import compress24, soft_compress24
from .transposable_mask import transposable_mask24
from .venom import venom_compress, venom_matmul

WIDTHS = (768, 1024, 1280, 1600)
TOKENS = (64, 256, 1024, 4096, 16384)
QUICK_WIDTHS = (768, 1600)
QUICK_TOKENS = (64, 16384)
ACT_V, ACT_M = 64, 8          # V:N:M defaults of the project (act_sparsity.v, .m)

# Entry names of XLA's own kernels (fusions, copies): not this package's.
_XLA_ENTRY = re.compile(r"^(loop_|input_|wrapped_|gemm_fusion|triton_|copy|transpose|"
                        r"fusion|slice|pad|concatenate|dynamic|reduce|convert|bitcast)")


@dataclasses.dataclass
class Case:
  """One jitted function of abstract inputs; `expect` maps each Pallas kernel (PTX entry
  name) it must contain to the tensor-core MMAs it is meant to use, any one of which must be
  in its PTX (None: a memory-bound kernel, no MMA expected)."""
  name: str
  shape: str
  fn: Callable
  args: tuple
  expect: dict[str, tuple[str, ...] | None]
  # Launch smem, when the kernel's module knows it and XLA's thunk sequence does not, and
  # an identity of the compiled kernel: Mosaic GPU caches kernels by module hash, so a
  # kernel identical to one compiled before leaves no new PTX; its report is reused.
  smem: dict[str, int] = dataclasses.field(default_factory=dict)
  key: dict[str, tuple] = dataclasses.field(default_factory=dict)
  labels: dict[str, str] = dataclasses.field(default_factory=dict)   # row names per entry


def _dense_mma(arch: str) -> tuple[str, ...]:
  """Tensor-core MMAs acceptable for the Triton kernels' dense dots on `arch`.

  mma.sync everywhere; where a dot's tile is large enough (>= 64 rows: dvalues,
  venom_matmul) Triton emits the generation's own MMA instead, wgmma on sm_90a and (dense)
  tcgen05.mma on sm_100a. The small token tiles of the memory-bound compressed matmul (16 and
  32 rows) get mma.sync, which is what those tiles are for.
  """
  return {"sm_80": ("mma.sync",), "sm_90a": ("mma.sync", "wgmma.mma_async"),
          "sm_100a": ("mma.sync", "tcgen05.mma")}[arch]


def cases(gpu: str, widths, tokens) -> list[Case]:
  """The kernels of this package at the given shapes, for the named GPU."""
  arch = target(gpu).arch
  mma = _dense_mma(arch)
  bf = jnp.bfloat16
  S = lambda shape, dtype=bf: aot.spec(shape, dtype, gpu)   # noqa: E731
  out: list[Case] = []

  def add(name, shape, fn, args, expect):
    out.append(Case(name, shape, fn, tuple(args), expect))

  weights = [(4 * d, d) for d in widths] + [(d, 4 * d) for d in widths]
  for (n, k) in weights:
    w = S((n, k))
    add("sparsify24", f"W{n}x{k}", lambda w: compress24(w),
        [w], {"sparsify24_hard": None})
    add("sparsify24_mask", f"W{n}x{k}",
        lambda w, m: compress24(w, m),
        [w, S((n, k), jnp.bool_)], {"sparsify24_mask": None})
    add("soft_compress24", f"W{n}x{k}",
        lambda w, b: soft_compress24(w, b),
        [w, S((), jnp.float32)], {"sparsify24_soft": None})
    add("transposable_mask24", f"W{n}x{k}",
        lambda w: transposable_mask24(w),
        [w], {"transposable_mask24": None})
    add("transposable_mask24_compressed", f"W{n}x{k}",
        lambda w: transposable_mask24(w, with_compressed=True),
        [w], {"transposable_mask24": None})

  for d in widths:
    h = 4 * d
    for t in tokens:
      for (n, k) in ((h, d), (d, h)):
        sh = f"T{t} W{n}x{k}"
        # The weight gradient operand dY^T (out, T), 2:4 along the tokens.
        add("mvue24", f"T{t} dYt{n}x{t}",
            lambda x, s: mvue24_compress(x, s),
            [S((n, t)), S((), jnp.uint32)], {"mvue24": None})
        x, vals, meta = S((t, k)), S((n, k // 2)), S((n, meta_words(k)), jnp.uint32)

        def fwd(x, v, m):
          return sparse24_matmul(x, v, m)

        def loss(x, v, m):
          return sparse24_matmul(x, v, m).astype(jnp.float32).sum()

        add("sparse24_matmul_fwd", sh, fwd, [x, vals, meta], {"sparse24_matmul_fwd": mma})
        # jax.grad: the forward's output is unused, so XLA drops its kernel.
        add("sparse24_matmul_bwd", sh, jax.grad(loss, argnums=(0, 1)), [x, vals, meta],
            {"sparse24_matmul_dx": mma, "sparse24_matmul_dvalues": mma})
      # V:N:M activations: h (T, 4d) feeding the second FFN matmul, W2 (d, 4d).
      blocks = h // ACT_M
      add("venom_compress", f"T{t} h{t}x{h}",
          lambda x: venom_compress(x, ACT_V, ACT_M),
          [S((t, h))], {"venom_sparsify": None})
      add("venom_matmul", f"T{t} h{t}x{h} W{d}x{h}",
          lambda v, m, cols, w: venom_matmul(v, m, cols, w, v=ACT_V, m=ACT_M),
          [S((t, 2 * blocks)), S((t, -(-blocks // 8)), jnp.uint32),
           S((t // ACT_V, blocks, 4), jnp.int32), S((d, h))], {"venom_matmul": mma})
      for kind in ("geglu", "swiglu"):
        def gated_loss(x, kind=kind):
          return gated_act(x, kind).astype(jnp.float32).sum()
        add(f"{kind}_fwd_bwd", f"T{t} x{t}x{2 * h}", jax.value_and_grad(gated_loss),
            [S((t, 2 * h))], {f"{kind}_fwd": None, f"{kind}_bwd": None})
  if arch == "sm_100a":
    out += _tcgen05_cases(gpu, widths, tokens)
  return out


def _tcgen05_cases(gpu: str, widths, tokens) -> list[Case]:
  """kernels/tcgen05.py's three GEMM forms at the GPT-2 FFN shapes (Blackwell only)."""
  bf = jnp.bfloat16
  S = lambda shape, dtype=bf: aot.spec(shape, dtype, gpu)   # noqa: E731
  name = "tcgen05_sparse_matmul"
  expect = {name: ("tcgen05.mma.sp",)}
  out = []
  for d in widths:
    for t in tokens:
      for (n_out, n_in) in ((4 * d, d), (d, 4 * d)):
        w = (S((n_out, n_in // 2)), S((n_out, meta_words(n_in)), jnp.uint32))
        wt = (S((n_in, n_out // 2)), S((n_in, meta_words(n_out)), jnp.uint32))
        sh = f"T{t} W{n_out}x{n_in}"
        # GEMM (M, N, K): sparse A is M x K, B is N x K.
        for case, fn, args, (m, n, k) in (
            ("tcgen05_forward", lambda x, v, m: tcgen05.forward(x, v, m),
             (S((t, n_in)), *w), (n_out, t, n_in)),
            ("tcgen05_data_grad", lambda dy, v, m: tcgen05.data_grad(dy, v, m),
             (S((t, n_out)), *wt), (n_in, t, n_out)),
            ("tcgen05_weight_grad", lambda dy, x, s: tcgen05.weight_grad(dy, x, s),
             (S((t, n_out)), S((t, n_in)), S((), jnp.uint32)), (n_out, n_in, t))):
          exp = {**expect, "mvue24": None} if case == "tcgen05_weight_grad" else expect
          out.append(Case(case, sh, fn, args, exp, {name: tcgen05.smem_bytes(k, n)},
                          {name: tcgen05.kernel_key(m, n, k)}, {name: case}))
  return out


# ---------------------------------------------------------------------------------------------
# Running the cases


_THUNK = re.compile(r"kCustomKernel .*?\] (\S+) grid: .*?shared_memory: (\d+) bytes")


def _launch_smem(dump: pathlib.Path, module: str) -> dict[str, int]:
  """Dynamic shared memory XLA reserves per kernel launch (from its thunk sequence)."""
  smem: dict[str, int] = {}
  for p in dump.glob(f"*{module}*thunk_sequence.txt"):
    for m in _THUNK.finditer(p.read_text()):
      smem[m.group(1)] = max(smem.get(m.group(1), 0), int(m.group(2)))
  return smem


_SEEN: dict[tuple, tuple] = {}   # Case.key value -> (KernelResources, shape first seen)


def run_case(case: Case, gpu: str, dump: pathlib.Path, pool) -> list[dict]:
  """Compiles one case; one record per expected kernel (or one failure record)."""
  module = f"cc_{case.name}"
  fn = case.fn
  t0 = time.time()
  base = {"kernel": None, "shape": case.shape, "case": case.name}
  try:
    named = _named(fn, module)
    aot.compile_for_gpu(named, *case.args, gpu=gpu)
  except Exception as e:   # noqa: BLE001  (a failing kernel must not hide the others)
    return [{**base, "kernel": case.name if len(case.expect) == 1 else k, "entry": k,
             "ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
             "registers": None, "spill_bytes": None, "smem_bytes": None,
             "instructions": {}, "expected": exp} for k, exp in case.expect.items()]
  compile_s = time.time() - t0
  files = aot.ptx_files(dump)   # the dump holds this case only (emptied after each)
  reports = [r for rs in pool.map(lambda p: aot.ptxas_report(p, gpu), files) for r in rs
             if not _XLA_ENTRY.match(r.entry)]
  launch = _launch_smem(dump, f"jit_{module}.")
  records = []
  for kname, expected in case.expect.items():
    found = [r for r in reports if r.entry == kname or r.entry.startswith(kname)]
    label = case.labels.get(kname, case.name if len(case.expect) == 1 else kname)
    rec = {**base, "kernel": label, "entry": kname, "expected": expected,
           "compile_s": round(compile_s, 2)}
    key = case.key.get(kname)
    if found and key is not None:
      _SEEN[key] = (max(found, key=lambda r: (r.spill_bytes, r.registers)), case.shape)
    elif not found and key in _SEEN:
      found, rec["reused_from"] = [_SEEN[key][0]], _SEEN[key][1]
    if not found:
      rec.update(ok=False, error=f"no PTX entry named {kname!r} (found "
                 f"{sorted({r.entry for r in reports})})", registers=None, spill_bytes=None,
                 smem_bytes=None, instructions={})
    else:
      r = max(found, key=lambda r: (r.spill_bytes, r.registers))
      instr = {k: v for k, v in r.instructions.items() if v}
      has_expected = expected is None or any(k in expected for k in instr)
      if r.sass_mma is not None:
        rec["sass_mma"] = r.sass_mma
      rec.update(registers=r.registers, spill_bytes=r.spill_bytes, stack_bytes=r.stack_bytes,
                 smem_bytes=r.smem_bytes + launch.get(r.entry, case.smem.get(kname, 0)),
                 instructions=instr,
                 expected_found=has_expected, arch=r.arch,
                 ok=r.spill_bytes == 0 and has_expected)
      if not rec["ok"]:
        rec["error"] = ("spills" if r.spill_bytes else
                        f"none of {'/'.join(expected)} in the PTX")
    records.append(rec)
  for p in dump.iterdir():   # keep the dump small: this case is done
    if p.is_file():
      p.unlink()
    else:
      shutil.rmtree(p, ignore_errors=True)
  return records


def _named(fn, name):
  def f(*a):
    return fn(*a)
  f.__name__ = f.__qualname__ = name
  return jax.jit(f)


def _fmt_row(r: dict) -> str:
  instr = ",".join(f"{k}x{v}" for k, v in sorted(r.get("instructions", {}).items())) or "-"
  status = "ok" if r["ok"] else f"FAIL ({r.get('error', '')[:60]})"
  num = lambda v: "-" if v is None else str(v)   # noqa: E731
  return (f"{r['kernel']:<30} {r['shape']:<24} {num(r.get('registers')):>4} "
          f"{num(r.get('smem_bytes')):>7} {num(r.get('spill_bytes')):>6}  "
          f"{instr:<26} {'/'.join(r.get('expected') or ['-']):<26} {status}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m s24jax.kernels.compile_check",
                              description=__doc__.split("\n")[0])
  p.add_argument("--gpu", required=True, choices=("a100", "h100", "b200"))
  p.add_argument("--json", default="", help="write one record per kernel and shape here")
  p.add_argument("--quick", action="store_true",
                 help="corner shapes only (d 768/1600, tokens 64/16384)")
  p.add_argument("--only", default="", help="comma-separated case names (e.g. venom_compress)")
  p.add_argument("--widths", default="", help="override: comma-separated d values")
  p.add_argument("--tokens", default="", help="override: comma-separated token counts")
  args = p.parse_args(argv)

  dump = pathlib.Path(tempfile.mkdtemp(prefix="compile_check_"))
  try:
    aot.start(dump)
  except aot.PluginMissing as e:
    print(f"kernels.compile_check: {e}", file=sys.stderr)
    return 2
  widths = QUICK_WIDTHS if args.quick else WIDTHS
  tokens = QUICK_TOKENS if args.quick else TOKENS
  if args.widths:
    widths = tuple(int(v) for v in args.widths.split(","))
  if args.tokens:
    tokens = tuple(int(v) for v in args.tokens.split(","))
  only = {s for s in args.only.split(",") if s}
  todo = [cs for cs in cases(args.gpu, widths, tokens) if not only or cs.name in only]
  print(f"kernels.compile_check: {len(todo)} compiles for {args.gpu} "
        f"({target(args.gpu).arch}), d {widths}, tokens {tokens}", flush=True)
  print(f"{'kernel':<30} {'shape':<24} {'regs':>4} {'smem':>7} {'spill':>6}  "
        f"{'tensor-core instructions':<26} {'expect (any of)':<26} status", flush=True)
  t0 = time.time()
  records: list[dict] = []
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    for case in todo:
      for r in run_case(case, args.gpu, dump, pool):
        r["gpu"] = args.gpu
        records.append(r)
        print(_fmt_row(r), flush=True)
  shutil.rmtree(dump, ignore_errors=True)
  bad = [r for r in records if not r["ok"]]
  print(f"{len(records)} kernel rows, {len(bad)} failed, {time.time() - t0:.0f} s")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(records, indent=1))
  return 1 if bad or not records else 0


if __name__ == "__main__":
  sys.exit(main())
