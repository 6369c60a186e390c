"""Run several configs side by side and tabulate them: the comparison scripts' engine.

    from s24jax.cli import compare
    table = compare.run_all([
        compare.Arm("dense", "experiments/gpt2_dense.py:tiny"),
        compare.Arm("sr_ste", "experiments/gpt2_sr_ste.py:tiny",
                        {"sparsity.sr_ste.decay": 6e-5}),
    ], root="runs/compare")
    print(table)

Each run goes to its own workdir under `root` (resumed, not redone, if already finished),
and the table reports final train/val loss, the unigram entropy, the flip rate at the end
and its peak, tokens/s and wall time. Extra columns come from `extra_keys`. Overrides are
type-checked like every command line's (s24jax/config_files.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any, Sequence

from s24jax import config_files
from s24jax import destinations
from s24jax import errors
from s24jax.training import loop
from s24jax import metrics as metrics_lib


@dataclasses.dataclass
class Arm:
  """One arm of a comparison: its name (the workdir under the root), config and overrides.
  (Not a run_spec.RunSpec, which is what one run trains, built from a config.)"""
  name: str
  config: str                                   # "path/to/file.py[:variant]"
  overrides: dict[str, Any] = dataclasses.field(default_factory=dict)   # dotted path -> value


def _summary(workdir: str, wall: float, extra_keys: Sequence[str]) -> dict[str, Any]:
  records = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  with open(os.path.join(workdir, "final_metrics.json"), encoding="utf-8") as f:
    final = json.load(f)
  _, flip = metrics_lib.series(records, "train/flip_rate")
  _, tps = metrics_lib.series(records, "perf/tokens_per_sec")
  row = {
      "val_loss": final.get("val/loss"),
      "train_loss": final.get("train/loss"),
      "unigram": final.get("data/unigram_entropy"),
      "flip_end": float(flip[-1]) if len(flip) else None,
      "flip_peak": float(flip.max()) if len(flip) else None,
      "tok_s": float(sorted(tps)[len(tps) // 2]) if len(tps) else None,
      "wall_s": wall,
  }
  for k in extra_keys:
    row[k] = final.get(k)
  return row


def run_all(runs: Sequence[Arm], root: str, *, extra_keys: Sequence[str] = (),
            log=print) -> str:
  """Trains every run (skipping finished ones) and returns a markdown table."""
  rows = []
  for r in runs:
    workdir = os.path.join(root, r.name)
    t0 = time.time()
    done = os.path.exists(os.path.join(workdir, "final_metrics.json"))
    if not done:
      log(f"== {r.name}: {r.config} {r.overrides}")
      loop.train_and_evaluate(config_files.load_config(r.config, r.overrides), workdir)
    rows.append((r, _summary(workdir, time.time() - t0 if not done else float("nan"),
                             extra_keys)))
  return markdown_table(rows, extra_keys)


def _fmt(v: Any) -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    if v != v:
      return "(cached)"
    return f"{v:.3e}" if 0 < abs(v) < 1e-2 else f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
  return str(v)


# Every table starts so: what tells an earlier table.md of this command from a user's file.
TABLE_HEAD = "| run | config | "
TABLE_NAME = "table.md"


def markdown_table(rows, extra_keys: Sequence[str] = ()) -> str:
  cols = ["val_loss", "train_loss", "unigram", "flip_end", "flip_peak", "tok_s", "wall_s",
          *extra_keys]
  head = TABLE_HEAD + " | ".join(cols) + " |"
  sep = "|" + "---|" * (len(cols) + 2)
  lines = [head, sep]
  for r, row in rows:
    ov = " ".join(f"{k}={v}" for k, v in r.overrides.items())
    lines.append(f"| {r.name} | `{r.config}` {ov} | " +
                 " | ".join(_fmt(row[c]) for c in cols) + " |")
  return "\n".join(lines)


def a_table(path: str) -> bool:
  """Whether `path` is a table this command wrote (its first line is a table's head)."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.readline().startswith(TABLE_HEAD)
  except (OSError, UnicodeDecodeError):
    return False


def script_main(description: str, runs: Sequence[Arm], default_root: str, *,
                extra_keys: dict[str, str] | None = None, appendix=None, argv=None) -> str:
  """The shared command line of the experiments/compare_*.py scripts.

  --root DIR, --steps N (override total_steps of every run), --only a,b (a subset). Prints
  the table (extra columns renamed per `extra_keys` {metric: column}), followed by
  `appendix(runs, root)` if given, and writes it to ROOT/table.md, replacing only an earlier
  table (`a_table`). ROOT/table.md is checked before any run starts (a folder or a user's
  file there, a read-only or full disk); a problem is one line and SystemExit 2, nothing
  written; a write that fails at the end is one line and SystemExit 5, the table printed
  above and the runs' workdirs intact (README, "Exit codes"). A run's own error is its one
  line and exit code.
  """
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--root", default=default_root)
  parser.add_argument("--steps", type=int, default=0,
                      help="override total_steps of every run (0: each config's own)")
  parser.add_argument("--only", default="", help="comma-separated run names")
  args = parser.parse_args(argv)
  if args.only:
    names = args.only.split(",")
    unknown = sorted(set(names) - {r.name for r in runs})
    if unknown:
      parser.exit(errors.EXIT_USER, f"{parser.prog}: --only: unknown runs {unknown}; valid: "
                  f"{', '.join(r.name for r in runs)}\n")
    runs = [r for r in runs if r.name in names]
  if args.steps:
    runs = [Arm(r.name, r.config, {**r.overrides, "total_steps": args.steps}) for r in runs]
  extra_keys = extra_keys or {}
  path = os.path.join(args.root, TABLE_NAME)
  try:
    destinations.check_file(path, what="a comparison table", flag="--root", replaces=a_table)
    table = run_all(runs, args.root, extra_keys=tuple(extra_keys))
    for key, short in extra_keys.items():
      table = table.replace(key, short)
    if appendix is not None:
      table += "\n\n" + appendix(runs, args.root)
    print(table)
    with destinations.writing(f"the table {path}", "The table above holds the results; the "
                              "runs' workdirs are intact."):
      destinations.write_atomic(path, table + "\n", replaces=a_table, what="a comparison table")
  except errors.KnownError as e:
    parser.exit(e.exit_code, f"{parser.prog}: {e}\n")
  return table
