"""Memory traffic of s24jax's cuSPARSELt compressions (layout.py's `compress` fused with the
projection that makes the operand 2:4), from a deviceless XLA:GPU compile: per case, the
kernels XLA launches, their bytes (s24jax/perf/step_census.py: every fusion's operands and
outputs) and the ratio to the ideal (every input read once, every output written once).

    python -m s24jax.perf.compression_traffic [--gpu h100] [--json FILE]

(--json: a new file, or this tool's own earlier records, never another file; written whole
after the compiles, its folder made if missing. Exit codes: 0; 2 a bad argument or no compile
plugin, one line, before any compile; 5 the file could not be written; 75 Ctrl-C; 1 a bug.)

A perf tool (issue 40's goal: each compression within 1.3x of the ideal); nothing in the
library imports it. The cases are the backend's (s24jax/sparse_ops/cusparselt.py), at GPT-2
124M's FFN (W 3072 x 768) and a Llama-7B-like one (W 11008 x 4096), T = 65536 tokens:

  hard               W~ = W * nm_mask(W) (STE / SR-STE), W f32, compressed in bf16
  soft_scale         0.9 * soft_threshold24(W) (S-STE), in bf16
  transposable_both  W~ and W~^T from a given transposable mask (Hu et al.), both compressed
  soft_fp8           S-STE quantized to e4m3 (s24jax/sparse_ops/fp8.py's amax scale), 8-bit layout
  mvue_dyT           masks.mvue24(key, dY^T), dY (T, N) bf16, compressed along T

The layout is the one the backend writes on that GPU (layout.for_target); the A100 has no
8-bit case. Bytes are XLA:GPU's own accounting (step_census): a fusion's operands count once,
also where its threads read parts of them twice (note 1).

Results, 2026-11-28, deviceless H100 compile, jax 0.10.2; not measured on a GPU. Before:
masks.py and layout.py as of commit bcc88e9; after: their per-member rewrite (kernels, MB,
ratio to the ideal):

  case               shape  before              after             ideal MB
  hard               124m    7    67.5  5.59     1    12.1  1.00      12.1
  soft_scale         124m    8    88.8  7.34     1    12.1  1.00      12.1
  transposable_both  124m   11    72.5  4.24     4    41.9  2.45      17.1
  soft_fp8           124m    7    81.7  7.49     5    36.9  3.38      10.9
  mvue_dyT           124m   14 10796.4 17.16     7  1938.1  3.08     629.1
  hard               4096    7  1200.5  5.20     2   479.1  2.07     231.1
  soft_scale         4096    8  1606.3  6.95     2   501.6  2.17     231.1
  transposable_both  4096   11  1318.8  4.03     4   800.3  2.45     326.9
  soft_fp8           4096    9  1741.6  8.35     5   704.5  3.38     208.5
  mvue_dyT           4096   14 38686.6 17.16     7  6944.1  3.08    2254.4

(--gpu a100, sm80 layout: hard 5.49 -> 1.78 and 5.10 -> 1.78, soft 7.24 -> 1.78 and
6.85 -> 2.17, transposable 4.10 -> 2.45 and 3.90 -> 2.17, MVUE 17.0 -> 10.9 at both shapes:
for the A100, XLA writes the Gumbel draws out.)

What keeps the rest from 1.3x (XLA's fusion decisions, read in `compiled.as_text()`):
  1. One buffer, two sections: the concatenate's values and metadata are written by different
     threads, each reading the whole input, so a one-kernel compression reads it twice (from
     L2 at 124M, where W is 9.4 MB; the census counts it once). At 4096, where W outgrows L2,
     XLA writes the keep flags (hard) or the threshold t (S-STE) out instead.
  2. transposable_both: two buffers, each needing all of W; W~^T's metadata, from a
     transposed source, gets a kernel of its own, which reads W once more (XLA keeps the
     words' transpose, which moves the minor dimension, out of the concatenate).
  3. soft_fp8: the amax pass reads W before quantizing (inherent to current scaling), and t,
     shared by that reduction and the compression, is written out.
  4. mvue_dyT: the estimate (Threefry draws, logs, divisions) is too costly for XLA to
     recompute in both sections, so it is written out (dY in, 0.4 GB out at 124M), then
     compressed from that transposed source (note 2's extra metadata kernel).
What would reach ~1x: a Pallas Mosaic GPU kernel that reads a tile of the input once
(dY row tiles, transposed in shared memory, for MVUE), projects or draws, and writes the
tile's values and its metadata bytes in the one pass.
"""
from __future__ import annotations

from s24jax.cli import command

if __name__ == "__main__":   # before the imports (jax): Ctrl-C while starting is one line
  command.guard_startup("s24jax.perf.compression_traffic")

# pylint: disable=wrong-import-position
import dataclasses
import json
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from s24jax import errors
from s24jax.cli import args as cli_args
from s24jax.sparse_ops import fp8 as fp8_lib
from s24jax.perf import outputs
from s24jax.perf import step_census
from s24jax.kernels import aot
from s24jax.kernels import masks
from s24jax.kernels.cusparselt import layout

GPUS = ("a100", "h100")   # the GPUs with a layout (layout.for_target)
CASES = ("hard", "soft_scale", "transposable_both", "soft_fp8", "mvue_dyT")


@dataclasses.dataclass(frozen=True)
class Shape:
  """A layer's FFN weight W (n, k) and the tokens T of its gradient dY (T, n)."""
  name: str
  n: int
  k: int
  tokens: int


SHAPES = (Shape("124m", 3072, 768, 65536), Shape("4096", 11008, 4096, 65536))


@dataclasses.dataclass(frozen=True)
class Case:
  """One compression to compile: `fn` on abstract `args`."""
  name: str
  layout: str                  # the layout of its (first) compressed operand
  fn: Callable[..., Any]
  args: tuple[Any, ...]        # abstract inputs on the compile-only GPU


def _compute_capability(gpu: str) -> tuple[int, int]:
  """The compute capability of the named GPU's compile-only device ("9.0" -> (9, 0))."""
  cc = getattr(aot.devices(gpu)[0], "compute_capability", None)
  if cc is None:
    raise RuntimeError(f"jax {jax.__version__}'s compile-only {gpu} device reports no "
                       "compute capability, so the layout it gets is unknown")
  return tuple(int(p) for p in str(cc).split(".")[:2])


def _layout(cc, element_bytes: int, m: int, k: int) -> layout.Layout:
  lay = layout.for_target(cc, element_bytes, m, k)
  if lay is None:
    raise ValueError(f"no s24jax layout for a ({m}, {k}) {element_bytes}-byte operand on "
                     f"compute capability {cc}")
  return lay


def cases(shape: Shape, gpu: str) -> list[Case]:
  """The five compressions at `shape` for `gpu` (no FP8 case without an 8-bit layout)."""
  cc = _compute_capability(gpu)
  n, k, t = shape.n, shape.k, shape.tokens
  w = aot.spec((n, k), jnp.float32, gpu)
  mask = aot.spec((n, k), jnp.bool_, gpu)
  dy = aot.spec((t, n), jnp.bfloat16, gpu)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=w.sharding)
  w16, wt16, dy16 = _layout(cc, 2, n, k), _layout(cc, 2, k, n), _layout(cc, 2, n, t)
  bf16 = lambda a: a.astype(jnp.bfloat16)   # noqa: E731

  def hard(w):
    return layout.compress(bf16(jnp.where(masks.nm_mask(w), w, 0)), w16)

  def soft_scale(w):
    return layout.compress(bf16(0.9 * masks.soft_threshold24(w)), w16)

  def transposable_both(w, mask):
    wt = bf16(jnp.where(mask, w, 0))
    return layout.compress(wt, w16), layout.compress(wt.T, wt16)

  def mvue_dyT(dy, key):
    return layout.compress(masks.mvue24(key, dy.T), dy16)

  out = [Case("hard", w16.name, hard, (w,)), Case("soft_scale", w16.name, soft_scale, (w,)),
         Case("transposable_both", w16.name, transposable_both, (w, mask))]
  w8 = layout.for_target(cc, 1, n, k)
  if w8 is not None:
    def soft_fp8(w):
      q, _ = fp8_lib.quantize(0.9 * masks.soft_threshold24(w), jnp.float8_e4m3fn)
      return layout.compress(q, w8)
    out.append(Case("soft_fp8", w8.name, soft_fp8, (w,)))
  out.append(Case("mvue_dyT", dy16.name, mvue_dyT, (dy, key)))
  return out


def _array_bytes(tree) -> int:
  """Bytes of the arrays in a tree of avals; PRNG keys (8 bytes) are left out."""
  return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)
             if not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key))


def ideal_bytes(fn: Callable[..., Any], args) -> int:
  """Every input read once and every output written once: the bytes of fn's arguments and
  results."""
  return _array_bytes(args) + _array_bytes(jax.eval_shape(fn, *args))


def measure(case: Case, shape: Shape, gpu: str) -> dict[str, Any]:
  """Compiles one case for `gpu` and counts its kernels and bytes (module docstring)."""
  _, compiled = aot.compile_for_gpu(case.fn, *case.args, gpu=gpu)
  kernels = step_census.census(compiled.as_text())
  total = sum(kn.count * kn.bytes for kn in kernels)
  ideal = ideal_bytes(case.fn, case.args)
  return dict(case=case.name, layout=case.layout, shape=shape.name, n=shape.n, k=shape.k,
              tokens=shape.tokens, gpu=gpu, kernels=sum(kn.count for kn in kernels),
              bytes=total, ideal_bytes=ideal, ratio=total / ideal,
              per_kernel=[(kn.name, kn.count * kn.bytes) for kn in kernels])


def run(shapes, gpu: str, only=CASES):
  """One record per case of `only` at each shape (`measure`), as they are compiled."""
  for shape in shapes:
    for case in cases(shape, gpu):
      if case.name in only:
        yield measure(case, shape, gpu)


def _row(r: dict[str, Any]) -> str:
  return (f"{r['case']:<18} {r['layout']:<11} {r['shape']:<5} {r['kernels']:>7} "
          f"{r['bytes'] / 1e6:>10.1f} {r['ideal_bytes'] / 1e6:>9.1f} {r['ratio']:>6.2f}")


def _records(path: str) -> bool:
  """Whether `path` holds this tool's records (what --json may replace): a JSON list of
  objects with a case and its ratio."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(data, list) and bool(data) and all(
      isinstance(r, dict) and {"case", "ratio"} <= set(r) for r in data)


def main(argv=None) -> int:
  """The tool's exit code (the module docstring)."""
  return command.run(_main, argv, name="s24jax.perf.compression_traffic")


def _main(argv) -> int:
  p = command.Parser(prog="python -m s24jax.perf.compression_traffic",
                     description=__doc__.split("\n")[0])
  p.add_argument("--gpu", default="h100", choices=GPUS)
  p.add_argument("--json", default=None, help="write one record per case here (a new file, or "
                 "this tool's earlier records)",
                 type=cli_args.output_file("this tool's records", "--json", replaces=_records))
  p.add_argument("--shapes", default=",".join(s.name for s in SHAPES),
                 help="comma-separated, of: " + ", ".join(s.name for s in SHAPES))
  p.add_argument("--only", default="", help="comma-separated case names")
  p.add_argument("--kernels", action="store_true", help="also list every kernel's bytes")
  args = p.parse_args(argv)
  known = {s.name: s for s in SHAPES}
  names = [s for s in args.shapes.split(",") if s]
  only = [c for c in args.only.split(",") if c] or list(CASES)
  for flag, given, valid in (("--shapes", names, list(known)), ("--only", only, CASES)):
    bad = [v for v in given if v not in valid]
    if bad:
      p.error(f"{flag}: unknown {', '.join(bad)}; valid: {', '.join(valid)}")
  try:
    aot.start()
  except aot.PluginMissing as e:
    raise errors.UserError(str(e)) from None
  print(f"{'case':<18} {'layout':<11} {'shape':<5} {'kernels':>7} {'MB':>10} {'ideal MB':>9} "
        f"{'ratio':>6}", flush=True)
  records = []
  for r in run([known[s] for s in names], args.gpu, only):
    records.append(r)
    print(_row(r), flush=True)
    if args.kernels:
      for name, b in r["per_kernel"]:
        print(f"    {name:<40} {b / 1e6:>10.1f}")
  if args.json:
    outputs.write(args.json, json.dumps(records, indent=1), what="the records",
                  replaces=_records, intact="The table above is complete; the file is as it was")
  return errors.EXIT_OK


if __name__ == "__main__":
  sys.exit(main())
