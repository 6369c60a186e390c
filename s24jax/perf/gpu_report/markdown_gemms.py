"""The markdown of the cuSPARSELt sections (layouts.py's and gemms.py's rows): one table of
layout checks, one table of GEMM rows per precision (markdown.py renders the rest)."""
from __future__ import annotations

from typing import Any

# A GEMM row's cells: (heading, variants shown as "a / b").
TIME_CELLS = (("2:4 ms, default / searched", ("sparse", "sparse_searched")),
              ("+ compression ms, s24jax / library",
               ("compress_s24jax+sparse", "compress_library+sparse")),
              ("dense ms", ("dense_xla",)),
              ("torch ms, 2:4 / + compression", ("torch_sparse", "torch_sparse+compress")),
              ("compression alone ms, s24jax / library",
               ("compress_s24jax", "compress_library")))


def fmt(v: Any, spec: str = ".3f") -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return format(v, spec)
  return str(v)


def layouts(rows: list[dict]) -> list[str]:
  ok = [r for r in rows if r.get("status") == "ok" and "mismatch" in r]
  if not ok:
    return []
  lines = ["s24jax's compressed bytes of a probe operand against the library's "
           "(compression.mismatch); where they differ, the probe and the library's bytes are "
           "in the files named.", "",
           "| type | op(A) (m, k) | used by | layout | verdict | files |",
           "|---|---|---|---|---|---|"]
  for r in ok:
    if r.get("layout") is None:
      verdict = "no s24jax layout: the library compresses"
    elif r["mismatch"] is None:
      verdict = "the same bytes"
    else:
      verdict = f"**differ**: {r['mismatch']}"
    files = ", ".join(f"[{p.rsplit('/', 1)[-1]}]({p})" for p in r.get("files") or []) or "-"
    lines.append(f"| {r['dtype']} | ({r['m']}, {r['k']}) | {'; '.join(r.get('used_by', []))} "
                 f"| {fmt(r.get('layout'))} | {verdict} | {files} |")
  return lines + [""]


def _pair(ms: dict, names: tuple[str, ...]) -> str:
  return " / ".join(fmt(ms.get(n)) for n in names)


def _algorithm(r: dict) -> str:
  alg = r.get("algorithm")
  return f"id {alg['alg_id']} of {alg['max_id']}" if alg else "-"


def _check(r: dict) -> str:
  if r.get("alg_check"):
    return f"**disagrees**: {r['alg_check']}"
  if r.get("alg_check_skipped"):
    return "not checked (D too large)" if "outputs" in r["alg_check_skipped"] else "-"
  return "agrees" if r.get("algorithm") else "-"


def _bandwidth(r: dict) -> str:
  b = r.get("compression_bandwidth") or {}
  if b.get("gb_per_s") is None:
    return "-"
  ratio = b.get("ratio_to_ideal")
  gbps = b["gb_per_s"]
  return (f"{gbps:.0f}" if gbps >= 100 else f"{gbps:.3g}") + (
      f" ({ratio:.2f}x ideal)" if ratio is not None else "")


def _versus_dense(r: dict) -> str:
  v = r.get("vs_dense") or {}
  if v.get("kernel_speedup") is None:
    return "-"
  cell = f"{v['kernel_speedup']:.2f}x"
  with_c = v.get("with_compression_speedup")
  if with_c:
    cell += "; with compression " + " / ".join(fmt(with_c.get(c), ".2f") for c in
                                                ("s24jax", "library"))
  return cell


def gemms(rows: list[dict]) -> list[str]:
  ok = [r for r in rows if r.get("status") == "ok" and "kind" in r and "ms" in r]
  older = sum(1 for r in rows if r.get("status") == "ok" and "ms" in r and "kind" not in r)
  lines = [f"{older} rows of an earlier format (a row per layer, not per GEMM) are not shown: "
           "the markdown written with them shows them.", ""] if older else []
  if not ok:
    return lines
  lines += ["Milliseconds per call (n calls in one jitted loop / n, the median of the loops; "
           "every JAX variant of a row in one compiled program; torch: CUDA events). `vs "
           "dense`: dense / 2:4 time of the faster algorithm, and where that is >= 1.10x, of "
           "each compression + GEMM (s24jax / library). `GB/s`: s24jax's compression, (bytes "
           "read + written) / time, and its time over one read and one write at the device's "
           "peak (the criterion: <= 1.3x).", ""]
  heading = ("| GEMM | W~ (N, K) | tokens | cuSPARSELt (m, n, k) layout | "
             + " | ".join(h for h, _ in TIME_CELLS)
             + " | s24jax GB/s | vs dense | algorithm | check against default |")
  for precision in sorted({r["precision"] for r in ok}):
    lines += [f"**{precision}**", "", heading, "|" + "---|" * (heading.count("|") - 1)]
    for r in (r for r in ok if r["precision"] == precision):
      g = r.get("gemm") or {}
      ms = r["ms"]
      lines.append(
          f"| {r['kind']} | {r['matrix']} {tuple(r['shape_NK'])} | {r['tokens']} | "
          f"({g.get('m')}, {g.get('n')}, {g.get('k')}) {g.get('layout', '')} | "
          + " | ".join(_pair(ms, names) for _, names in TIME_CELLS)
          + f" | {_bandwidth(r)} | {_versus_dense(r)} | {_algorithm(r)} | {_check(r)} |")
    lines.append("")
  errors = [f"- {r['row']} {k}: `{v}`" for r in ok for k, v in (r.get("errors") or {}).items()]
  return lines + (["Cells that failed:", *errors, ""] if errors else [])
