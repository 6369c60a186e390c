"""The report's markdown, regenerated from its record (rows.py) at any point: after each
section, at the end, after a SIGTERM, or later (`--markdown-from`)."""
from __future__ import annotations

import collections
from typing import Any

from s24jax.gpu_report import sections as sections_lib

ENV_FIELDS = ("device", "device_count", "compute_capability", "nvidia_smi", "cuda_driver_api",
              "jax", "jaxlib", "jax_cuda_plugin", "flax", "optax", "orbax_checkpoint",
              "numpy", "cusparselt", "cusparselt_wheel", "cuda_runtime_wheel", "torch",
              "torch_cuda", "torch_cusparselt", "python", "date", "git_commit", "git_dirty")
GEMM_COLUMNS = ("sparse", "sparse+compress", "dense_xla", "torch_sparse",
                "torch_sparse+compress")

TITLE = "# GPU report (`python -m s24jax.gpu_report`)"


def _fmt(v: Any, spec: str = ".3f") -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return format(v, spec)
  return str(v)


def _others(rows: list[dict]) -> list[str]:
  """The failed, skipped and cut rows of a section, one line each."""
  out = []
  for r in rows:
    if r.get("status") == "failed":
      out.append(f"- **failed** {r['row']}: `{r.get('error', '')}`")
    elif r.get("status") in ("skipped", "cut"):
      out.append(f"- {r['status']} {r['row']}: {r.get('reason', '')}")
  return out


def _environment(rows: list[dict]) -> list[str]:
  ok = [r for r in rows if r.get("status") == "ok"]
  if not ok:
    return []
  env = ok[-1]
  return ["| field | value |", "|---|---|",
          *(f"| {k} | {_fmt(env.get(k))} |" for k in ENV_FIELDS if k in env), ""]


def _pytest(rows: list[dict]) -> list[str]:
  tests = [r for r in rows if "outcome" in r]
  counts = collections.Counter(r["outcome"] for r in tests)
  lines = [f"Tests that finished: {len(tests)} ("
           + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) + ")." if tests
           else "No test finished."]
  for r in rows:
    if r.get("row") == "(summary)":
      lines.append(f"pytest exit code {r.get('exit_code')} after {_fmt(r.get('seconds'), '.0f')}"
                   f" s: `{r.get('summary_line', '')}`; command `{r.get('command', '')}`.")
  lines.append("")
  bad = [r for r in tests if r["outcome"] in ("failed", "error")]
  if bad:
    lines += ["| failed test | first error line |", "|---|---|",
              *(f"| `{r['row']}` | `{r.get('error', '')}` |" for r in bad), ""]
  reasons = collections.Counter(r.get("reason", "") for r in tests if r["outcome"] == "skipped")
  if reasons:
    lines += ["Skipped: " + "; ".join(f"{n} x {why}" for why, n in reasons.most_common()), ""]
  return lines


def _gemms(rows: list[dict]) -> list[str]:
  ok = [r for r in rows if r.get("status") == "ok" and "ms" in r]
  if not ok:
    return []
  lines = ["Milliseconds per call (n calls in one jitted loop / n; torch: CUDA events), as "
           + " / ".join(GEMM_COLUMNS) + "; max relative error of the op's y / dX / dW "
           "against 'xla'.", "",
           "| width | matrix (N, K) | tokens | precision | error y / dX / dW | forward ms | "
           "dgrad ms | wgrad ms |", "|---|---|---|---|---|---|---|---|"]
  for r in ok:
    e = r["max_rel_error_vs_xla"]
    cells = [" / ".join(_fmt(r["ms"][g].get(c)) for c in GEMM_COLUMNS)
             for g in ("forward", "dgrad", "wgrad")]
    lines.append(f"| {r['width']} | {r['matrix']} {tuple(r['shape_NK'])} | {r['tokens']} | "
                 f"{r['precision']} | {e['y']:.1e} / {e['dX']:.1e} / {e['dW']:.1e} | "
                 + " | ".join(cells) + " |")
  errors = [f"- {r['row']} {k}: `{v}`" for r in ok for k, v in (r.get("errors") or {}).items()]
  return lines + [""] + (["Cells that failed:", *errors, ""] if errors else [])


def _steps(rows: list[dict]) -> list[str]:
  ok = [r for r in rows if r.get("status") == "ok" and "step_ms" in r]
  if not ok:
    return []
  # The 'xla' row's program per (variant, recipe): a row with the same program runs the same
  # kernels (steps.py), so its time differs from that row's by noise only.
  xla = {(r["variant"], r["recipe"]): r.get("program") for r in ok if r["backend"] == "xla"}
  lines = ["| variant (layers) | recipe | backend | gemm_choice | micro-batch | step ms "
           "(rounds) | tokens/s | compiled GiB/device | compile s | program |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in ok:
    rounds = r.get("step_ms_rounds") or []
    spread = f" ({min(rounds):.1f}-{max(rounds):.1f})" if len(rounds) > 1 else ""
    program = r.get("program") or "-"
    if r["backend"] != "xla" and program != "-" and xla.get((r["variant"], r["recipe"])) == program:
      program += " (= xla)"
    lines.append(f"| {r['variant']} ({r['layers']}) | {r['recipe']} | {r['backend']} | "
                 f"{r.get('gemm_choice') or 'default'} | {r['micro_batch']} | "
                 f"{r['step_ms']:.1f}{spread} | {r['tokens_per_sec']:.0f} | "
                 f"{r['compiled_gib_per_device']:.2f} | {r['compile_s']:.1f} | {program} |")
  return lines + [""]


_BODY = {"environment": _environment, "gpu_tests": _pytest, "gemms": _gemms,
         "steps": _steps, "quick_suite": _pytest}


def render(rows: list[dict]) -> str:
  by_section = collections.defaultdict(list)
  for r in rows:
    by_section[r.get("section")].append(r)
  report = by_section.get("report", [])
  start = next((r for r in report if r.get("row") == "start"), {})
  end = next((r for r in report if r.get("row") == "end"), None)
  lines = [TITLE, "",
           f"Command: `{start.get('command', '?')}`; budget {start.get('budget', '?')} s.  ",
           (f"Ended after {_fmt(end.get('t'), '.0f')} s: {end.get('reason', '')}." if end
            else "Not ended: this is what the record held when the markdown was written."),
           ""]
  if start.get("smoke"):
    lines += ["**Smoke run on a CPU with the cuSPARSELt stand-in, tiny shapes: no figure here "
              "says anything about a GPU.**", ""]
  for spec in sections_lib.SECTIONS:
    section_rows = by_section.get(spec.name, [])
    lines += [f"## {spec.title}", ""]
    if not section_rows:
      lines += ["Not run (the report ended before it).", ""]
      continue
    lines += _BODY[spec.name](section_rows)
    others = _others(r for r in section_rows if "outcome" not in r)
    lines += others + ([""] if others else [])
  return "\n".join(lines).rstrip() + "\n"
