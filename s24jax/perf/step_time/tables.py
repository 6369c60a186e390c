"""Markdown and text tables of censuses, of the model's fit per device, and of its times."""
from __future__ import annotations

from typing import Any

from s24jax.perf import roofline
from s24jax.perf import step_census


def category_cells(kernels, c: roofline.Constants | None, table) -> dict[str, str]:
  """category -> 'launches / TFLOP / GB [/ ms]' of one step."""
  rows = step_census.summarize(kernels)
  ms = roofline.by_category(kernels, c, table) if c else {}
  out = {}
  for cat, r in rows.items():
    if r.launches:
      cell = f"{r.launches} / {r.flops / 1e12:.2f} / {r.bytes / 1e9:.1f}"
      out[cat] = cell + (f" / {1e3 * ms[cat]:.1f}" if c else "")
  return out


def census_markdown(named: dict[str, Any], c, table) -> str:
  """One column per step, one row per category (module docstring of step_census)."""
  cells = {name: category_cells(k, c, table) for name, k in named.items()}
  head = "| category | " + " | ".join(named) + " |"
  lines = [head, "|---" * (len(named) + 1) + "|"]
  for cat in step_census.CATEGORIES:
    if any(cat in v for v in cells.values()):
      lines.append(f"| {cat} | " + " | ".join(cells[n].get(cat, "-") for n in named) + " |")
  totals = []
  for name, kernels in named.items():
    s = step_census.summarize(kernels)
    launches = sum(r.launches for r in s.values())
    t = f" / {1e3 * roofline.step_seconds(kernels, c, table):.1f}" if c else ""
    totals.append(f"{launches} / {sum(r.flops for r in s.values()) / 1e12:.2f} / "
                  f"{sum(r.bytes for r in s.values()) / 1e9:.1f}{t}")
  lines.append("| **step** | " + " | ".join(totals) + " |")
  return "\n".join(lines)


def top_kernels(kernels, c, table, n: int) -> str:
  ranked = sorted(kernels, key=lambda k: -k.count * (roofline.kernel_seconds(k, c, table)
                                                     if c else k.bytes))[:n]
  lines = []
  for k in ranked:
    t = f"{1e3 * k.count * roofline.kernel_seconds(k, c, table):7.2f} ms  " if c else ""
    lines.append(f"  {t}{k.count:4d} x {k.name} ({k.category}; {k.flops / 1e9:.1f} GFLOP, "
                 f"{k.bytes / 1e6:.0f} MB{'; ' + k.branch if k.branch else ''}) {k.op_name[-80:]}")
  return "\n".join(lines)


def ms(value: float | None) -> str:
  return "-" if value is None else f"{value:.1f}"


def model_ms(fit, kernels) -> str:
  """The step's model time on a fitted device ('-' where its table lacks a GEMM)."""
  try:
    return ms(1e3 * fit.step_seconds(kernels))
  except roofline.MissingGemm:
    return "-"


def validation_markdown(fit) -> str:
  """A device's constants, each row's error in-sample and left out, and both summaries
  (validation.DeviceFit)."""
  lines = [f"## {fit.device} ({', '.join(r.folder for r in fit.runs)}): "
           f"{fit.constants.describe()}\n",
           "| measured row | measured ms | model ms | error | left out: model ms | error |",
           "|---|---|---|---|---|---|"]
  for m, model, loo, err, loo_err in zip(fit.rows, fit.model_s, fit.loo_s, fit.errors(),
                                         fit.errors(loo=True)):
    lines.append(f"| {m.row.name} | {1e3 * m.row.seconds:.1f} | {1e3 * model:.1f} | "
                 f"{100 * err:+.1f} % | {1e3 * loo:.1f} | {100 * loo_err:+.1f} % |")
  lines.append("")
  for label, loo in (("in-sample", False), ("leave-one-out", True)):
    s = fit.summary(loo)
    lines.append(f"{label}: |error| median {100 * s['median_abs_error']:.1f} %, max "
                 f"{100 * s['max_abs_error']:.1f} %; ranking: Kendall's tau "
                 f"{s['kendall_tau']:+.2f} ({s['discordant_pairs']} discordant, "
                 f"{s['tied_pairs']} tied of "
                 f"{s['concordant_pairs'] + s['discordant_pairs'] + s['tied_pairs']} pairs; the "
                 f"widest discordant pair measured {100 * s['widest_discordant_gap']:.1f} % "
                 "apart)")
  return "\n".join(lines)


def predictions_markdown(rows: list[dict[str, Any]]) -> str:
  """One line per predicted row name: its shape, dense ms and tokens/s, and each sparse arm
  as ms (speed relative to dense: dense ms / ms)."""
  names = list(dict.fromkeys(r["name"] for r in rows))
  arms = list(dict.fromkeys((r["recipe"], r["backend"]) for r in rows if r["recipe"] != "dense"))
  label = {"hu2024": "Hu et al.", "s_ste": "S-STE"}
  head = ("| row | layers x width | micro-batch x seq | dense ms (tokens/s) | " +
          " | ".join(f"{label.get(a, a)} `{b}`" for a, b in arms) + " |")
  lines = [head, "|---" * (4 + len(arms)) + "|"]
  for name in names:
    by_arm = {(r["recipe"], r["backend"]): r for r in rows if r["name"] == name}
    dense = by_arm.get(("dense", "xla"))
    dense = dense if dense and dense["step_ms"] else None
    first = next(iter(by_arm.values()))
    cells = [name, f"{first['num_layers']} x {first['d_model']}",
             f"{first['micro_batch']} x {first['seq_len']}",
             f"{dense['step_ms']:.0f} ({dense['tokens_per_sec'] / 1e3:.0f}k)" if dense else "-"]
    for arm in arms:
      r = by_arm.get(arm)
      if r is None or r["step_ms"] is None:
        cells.append("-")
      elif dense:
        cells.append(f"{r['step_ms']:.0f} ({dense['step_ms'] / r['step_ms']:.2f}x)")
      else:
        cells.append(f"{r['step_ms']:.0f}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
