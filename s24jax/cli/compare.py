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

A run already in its workdir is reused (resumed, or tabulated if finished) only if it was made
with exactly the config asked for (`check_reusable`): a table row is labelled with what the
command asked for, and a run of an earlier `--steps` or an edited config file would be shown
under that label. Every arm is checked before any run starts; one that differs stops the
comparison with one line naming the fields (a UserError, exit code 2), nothing run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Sequence

from s24jax import destinations
from s24jax import errors
from s24jax.cli import args as args_lib
from s24jax.cli import command
from s24jax.training import loop
from s24jax.training import validate
from s24jax.training import workdir as workdir_lib
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


# Fields that say where a run keeps its files, not what it trains: a run reused from another
# machine or cache folder is the same run.
WHERE_NOT_WHAT = ("data.cache_dir", "data.tfds_data_dir")


def check_reusable(workdir: str, config, *, remedy: str) -> None:
  """The run in `workdir`, if any, was made with `config` (module docstring): else a UserError
  naming the fields that differ and `remedy` (what to do). A workdir the loop would refuse (a
  file, a folder where it keeps a file) is refused here, as the loop says it."""
  workdir_lib.check(workdir)
  recorded = workdir_lib.last_config(workdir)
  if recorded is None:
    if os.path.exists(os.path.join(workdir, "final_metrics.json")):
      raise errors.UserError(f"{workdir} holds results but no config.json: what they were "
                             f"run with is unknown. {remedy} (nothing was run)")
    return
  changed = {k: v for k, v in workdir_lib.changed_fields(
      recorded, workdir_lib.as_json(config)).items() if k not in WHERE_NOT_WHAT}
  if changed:
    shown = "; ".join(f"{k}: {v['was']!r} there, {v['now']!r} asked"
                      for k, v in list(changed.items())[:4])
    more = f"; and {len(changed) - 4} more" if len(changed) > 4 else ""
    raise errors.UserError(
        f"{workdir} holds a run of another config ({shown}{more}): reusing it would label "
        f"its results with this command's. {remedy} (nothing was run)")


def run_all(runs: Sequence[Arm], root: str, *, extra_keys: Sequence[str] = (),
            log=print) -> str:
  """Trains every run (reusing one already made with its config: `check_reusable`) and
  returns a markdown table. Every arm's config (its values) and workdir are checked before any
  run starts: nothing runs unless every run can."""
  configs = []
  for r in runs:
    try:
      configs.append(validate.load_config(r.config, r.overrides))
      validate.check_config(configs[-1])
    except errors.UserError as e:
      raise errors.UserError(f"run {r.name!r}: {e}") from e
    workdir = os.path.join(root, r.name)
    check_reusable(workdir, configs[-1], remedy=f"Choose another root (--root), or move "
                   f"{workdir} away")
  rows = []
  for r, config in zip(runs, configs):
    workdir = os.path.join(root, r.name)
    t0 = time.time()
    done = os.path.exists(os.path.join(workdir, "final_metrics.json"))
    if not done:
      log(f"== {r.name}: {r.config} {r.overrides}")
      loop.train_and_evaluate(config, workdir)
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
  parser = command.Parser(description=description)
  parser.add_argument("--root", default=default_root)
  parser.add_argument("--steps", type=args_lib.integer(minimum=0), default=0,
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
