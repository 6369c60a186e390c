"""The report's markdown, regenerated from its record (rows.py) at any point: after each
section, at the end, after a SIGTERM, or later (`--markdown-from`). Its first lines say so
when a row ran on a cuSPARSELt other than the pinned one (`version_warning`); each section
ends with the libcusparseLt its processes used (`libraries_lines`, from the rows'
`libraries`: libraries.py); markdown_gemms.py renders the cuSPARSELt sections' tables."""
from __future__ import annotations

import collections

from s24jax.perf.gpu_report import markdown_gemms
from s24jax.perf.gpu_report import sections as sections_lib

ENV_FIELDS = ("device", "device_count", "compute_capability", "nvidia_smi", "cuda_driver_api",
              "jax", "jaxlib", "jax_cuda_plugin", "flax", "optax", "orbax_checkpoint",
              "numpy", "cusparselt", "cusparselt_wheel", "cuda_runtime_wheel", "torch",
              "torch_cuda", "torch_cusparselt", "python", "date", "git_commit", "git_dirty")

TITLE = "# GPU report (`python -m s24jax.perf.gpu_report`)"


_fmt = markdown_gemms.fmt


def serving_versions(rows: list[dict]) -> dict[str, str]:
  """{version: a file that served it} over every row's `libraries`."""
  out = {}
  for r in rows:
    serving = (r.get("libraries") or {}).get("cusparselt_serving")
    if isinstance(serving, dict) and serving.get("version"):
      out.setdefault(serving["version"], serving.get("path", "?"))
  return out


def version_warning(rows: list[dict]) -> str | None:
  """One sentence when a row's cuSPARSELt is not the version the repository pins (the
  report's start row's `cusparselt_pinned`), else None."""
  start = next((r for r in rows if r.get("section") == "report" and r.get("row") == "start"),
               {})
  pinned = start.get("cusparselt_pinned")
  if not pinned or str(pinned).startswith("unknown"):
    return None
  others = {v: p for v, p in serving_versions(rows).items() if v != pinned}
  if not others:
    return None
  ran = " and ".join(f"{v} ({p})" for v, p in sorted(others.items()))
  return (f"This report ran on cuSPARSELt {ran}, not the version the repository pins, "
          f"{pinned} (requirements-cusparselt.txt): its cuSPARSELt figures are not the "
          "pinned library's.")


def libraries_lines(rows: list[dict]) -> list[str]:
  """The libcusparseLt of a section's processes, in one line (libraries.py's fields)."""
  libs = [r["libraries"] for r in rows if isinstance(r.get("libraries"), dict)]
  if not libs:
    return []
  serving = sorted({f"{s['version']} (`{s['path']}`)" for l in libs
                    if isinstance(s := l.get("cusparselt_serving"), dict)})
  torch = [l["torch"] for l in libs if isinstance(l.get("torch"), dict)]
  order = [l.get("cusparselt_load_order") or [] for l in libs]
  order += [t.get("load_order_after_torch") or [] for t in torch]
  mapped = {p for l in libs for p in l.get("cusparselt_mapped") or []}
  mapped |= {p for t in torch for p in t.get("mapped_after_torch") or []}
  line = (f"libcusparseLt in {len({l.get('pid') for l in libs})} process(es): serving s24jax "
          f"{', '.join(serving) or 'not named (no s24jax handler loaded)'}; mapped "
          + (", ".join(f"`{p}`" for p in sorted(mapped)) or "none"))
  firsts = sorted({o[0] for o in order if o})
  if firsts:
    line += "; loaded first (it serves every user): " + ", ".join(f"`{p}`" for p in firsts)
  if torch:
    line += "; torch's own cuSPARSELt " + ", ".join(sorted(
        {str(t.get("cusparselt_version", t.get("error"))) for t in torch}))
  return [line + ".", ""]


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


_BODY = {"environment": _environment, "layouts": markdown_gemms.layouts, "gpu_tests": _pytest,
         "gemms": markdown_gemms.gemms, "steps": _steps, "quick_suite": _pytest}


def render(rows: list[dict]) -> str:
  by_section = collections.defaultdict(list)
  for r in rows:
    by_section[r.get("section")].append(r)
  report = by_section.get("report", [])
  start = next((r for r in report if r.get("row") == "start"), {})
  end = next((r for r in report if r.get("row") == "end"), None)
  warning = version_warning(rows)
  lines = [TITLE, "", *([f"**{warning}**", ""] if warning else []),
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
      asked = spec.name in start.get("sections", [spec.name])
      lines += ["Not run (the report ended before it)." if asked else
                "Not run (not among this report's sections).", ""]
      continue
    lines += _BODY[spec.name](section_rows)
    lines += libraries_lines(section_rows)
    others = _others(r for r in section_rows if "outcome" not in r)
    lines += others + ([""] if others else [])
  return "\n".join(lines).rstrip() + "\n"
