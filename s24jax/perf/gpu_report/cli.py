"""The command line of `python -m s24jax.perf.gpu_report` (the package docstring says what it does).

Each section runs in a child process with its cap (sections.py); the record (rows.py) is
appended as rows end, and the markdown is rewritten from it after every section and at the
end, also when the report is stopped (SIGTERM, Ctrl-C: the running child is ended first).
Exit 0 when the report ran, whatever its rows say (a failed row is a finding); 2 off a GPU
without --smoke or on a bad argument; 75 when stopped by SIGTERM / SIGINT (its markdown
written from what finished).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import time

from s24jax import destinations
from s24jax import errors
from s24jax.perf.gpu_report import children
from s24jax.perf.gpu_report import markdown
from s24jax.perf.gpu_report import rows
from s24jax.perf.gpu_report import sections as sections_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXIT_NO_GPU = errors.EXIT_USER
DEFAULT_BUDGET = 420.0     # seconds: a GPU host lent for 10 minutes, less ~1 minute of set-up
DEFAULT_NAME = "gpu_report_latest"
# In the report's folder of logs: the folder is the report's, which a new report replaces.
LOGS_MARK = ".s24jax_gpu_report"
RESERVE = 8.0              # seconds kept at the end: ending a child, the last markdown


class Stopped(Exception):
  """The report received a signal."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def _raise(signum, frame):
  del frame
  raise Stopped(signum)


def write_markdown(jsonl: str, md: str) -> None:
  text = markdown.render(rows.read(jsonl))
  tmp = md + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, md)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m s24jax.perf.gpu_report",
                              description="GPU evidence in one time-capped run.")
  p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                 help=f"seconds for the whole report (default {DEFAULT_BUDGET:.0f})")
  p.add_argument("--out", default=os.path.join(REPO, "docs"), help="folder of the report")
  p.add_argument("--name", default=DEFAULT_NAME,
                 help="file names: NAME.md, NAME.jsonl and the folder NAME/ (logs)")
  p.add_argument("--sections", default=",".join(s.name for s in sections_lib.SECTIONS),
                 help="comma-separated, in the report's order")
  p.add_argument("--smoke", action="store_true",
                 help="a CPU check of the script: tiny shapes, the cuSPARSELt stand-in")
  p.add_argument("--markdown-from", default="", metavar="JSONL",
                 help="only rewrite the markdown of this record (beside it) and exit")
  return p


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _parser().parse_args(argv)
  if args.markdown_from:
    if not os.path.exists(args.markdown_from):
      print(f"s24jax.perf.gpu_report: no record at {args.markdown_from}", file=sys.stderr)
      return errors.EXIT_USER
    md = os.path.splitext(args.markdown_from)[0] + ".md"
    write_markdown(args.markdown_from, md)
    print(f"wrote {md}")
    return 0
  names = tuple(n for n in args.sections.split(",") if n)
  unknown = [n for n in names if n not in sections_lib.BY_NAME]
  if unknown:
    print(f"s24jax.perf.gpu_report: unknown section(s) {', '.join(unknown)}; valid: "
          f"{', '.join(sections_lib.BY_NAME)}", file=sys.stderr)
    return errors.EXIT_USER
  names = tuple(s.name for s in sections_lib.SECTIONS if s.name in names)
  try:
    check_out(args.out, args.name)
  except destinations.DestinationError as e:
    print(f"s24jax.perf.gpu_report: {e}", file=sys.stderr)
    return e.exit_code
  start = time.time()
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # share the GPU
  import jax  # pylint: disable=g-import-not-at-top  (after the allocator setting)
  if jax.default_backend() != "gpu" and not args.smoke:
    print(f"s24jax.perf.gpu_report: no GPU here (jax.default_backend() = "
          f"{jax.default_backend()!r}): the report is GPU evidence. Run it on a GPU host, "
          "or with --smoke for a CPU check of the script.", file=sys.stderr)
    return EXIT_NO_GPU
  return run(args, names, start, shlex.join(["python", "-m", "s24jax.perf.gpu_report", *argv]))


def _a_report(path: str) -> bool:
  """Whether `path` is what this command wrote: a JSONL whose first row is the report's
  start row, or a markdown beginning with its title."""
  try:
    with open(path, encoding="utf-8") as f:
      first = f.readline()
  except (OSError, UnicodeDecodeError):
    return False
  return first.startswith(markdown.TITLE) or first.startswith('{"section": "report"')


def check_out(out: str, name: str) -> None:
  """Before anything runs: the report's folder writable, and what the report replaces (its
  .jsonl, .md and folder of logs from an earlier run) its own; anything else of that name is
  left as it is and refused (DestinationError: one line, exit 2)."""
  jsonl, md, logs = (os.path.join(out, name + ext) for ext in (".jsonl", ".md", ""))
  for path, what in ((jsonl, "a GPU report's rows"), (md, "a GPU report")):
    destinations.check_file(path, what=what, flag="--out/--name", replaces=_a_report)
  if os.path.lexists(logs) and not (os.path.isdir(logs) and
                                    os.path.exists(os.path.join(logs, LOGS_MARK))):
    raise destinations.DestinationError(
        f"--out/--name {logs} exists and is not a GPU report's folder of logs: it is left as "
        "it is; choose another --out or --name (nothing was written)")


def pinned_cusparselt() -> str:
  """The cuSPARSELt version the repository pins, or 'unknown: why' (the report still runs)."""
  from s24jax.kernels.cusparselt import library  # pylint: disable=g-import-not-at-top  (jax)
  try:
    return library.pinned_version()
  except ValueError as e:
    return f"unknown: {e}"


def run(args, names: tuple[str, ...], start: float, command: str) -> int:
  os.makedirs(args.out, exist_ok=True)
  jsonl = os.path.join(args.out, args.name + ".jsonl")
  md = os.path.join(args.out, args.name + ".md")
  files = os.path.join(args.out, args.name)
  for old in (jsonl, md):          # a new report replaces the last one
    if os.path.exists(old):
      os.remove(old)
  shutil.rmtree(files, ignore_errors=True)     # an earlier report's logs (check_out)
  os.makedirs(files)
  open(os.path.join(files, LOGS_MARK), "w", encoding="utf-8").close()
  os.environ[rows.ENV_T0] = repr(start)
  env = dict(os.environ, **{rows.ENV_JSONL: jsonl, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  if args.smoke:
    env["JAX_PLATFORMS"] = "cpu"
  end = start + args.budget
  rows.append(jsonl, {"section": "report", "row": "start", "status": "ok", "command": command,
                      "budget": args.budget, "smoke": args.smoke, "sections": list(names),
                      "cusparselt_pinned": pinned_cusparselt()})
  old_handlers = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGINT)}
  reason, code, warned = "every section ran or was skipped", 0, None
  try:
    for i, name in enumerate(names):
      run_section(sections_lib.BY_NAME[name], names[i:], end, jsonl, files, env, args.smoke)
      write_markdown(jsonl, md)
      warned = warned or print_warning(jsonl)
  except Stopped as e:
    reason, code = f"stopped by {e}", errors.EXIT_PREEMPTED
  finally:
    for s, h in old_handlers.items():
      signal.signal(s, h)
    rows.append(jsonl, {"section": "report", "row": "end", "status": "ok", "reason": reason,
                        "seconds": round(time.time() - start, 1)})
    write_markdown(jsonl, md)
  print(f"s24jax.perf.gpu_report: {reason} in {time.time() - start:.0f} s of {args.budget:.0f}; "
        f"wrote {md} and {jsonl}", flush=True)
  print_warning(jsonl)        # again, beside the summary
  return code


def print_warning(jsonl: str) -> str | None:
  """Prints the record's warning that a cuSPARSELt other than the pinned one ran
  (markdown.version_warning), if it has one; returns it."""
  warning = markdown.version_warning(rows.read(jsonl))
  if warning:
    print(f"s24jax.perf.gpu_report: WARNING: {warning}", flush=True)
  return warning


def run_section(spec: sections_lib.Section, names: tuple[str, ...], end: float, jsonl: str,
                files: str, env: dict, smoke: bool) -> None:
  section = rows.Section(jsonl, spec.name)
  left = end - RESERVE - time.time()
  cap = sections_lib.cap(spec.name, left, names)
  if cap < spec.minimum:
    section.skipped("(section)", f"budget: {max(cap, 0):.0f} s for it of {max(left, 0):.0f} s "
                    f"left; it needs at least {spec.minimum:.0f} s")
    print(f"[{spec.name}] skipped for the budget", flush=True)
    return
  log = os.path.join(files, spec.name + ".log")
  print(f"[{spec.name}] up to {cap:.0f} s", flush=True)
  if spec.pytest:
    cmd, extra = sections_lib.pytest_command(spec.name, smoke, files)
    code, seconds = children.run(cmd, cwd=REPO, env={**env, **extra,
                                 "S24JAX_GPU_REPORT_SECTION": spec.name},
                                 log_path=log, timeout=cap)
    tail = children.tail(log, 1)
    fields = dict(exit_code=code, seconds=round(seconds, 1), summary_line=tail[0] if tail else "",
                  command=shlex.join(["python", *cmd[1:]]))
    if code is None:
      section.cut(f"pytest stopped at the section's cap of {cap:.0f} s; the tests above are "
                  "those that finished")
    if code in (None, 0, 1, 5):   # ran (5: no test selected)
      section.ok("(summary)", **fields)
    else:
      section.failed("(summary)", RuntimeError(f"pytest exited with code {code}: "
                                               f"{fields['summary_line']} (log: {log})"), **fields)
  else:
    # The child starts no row it cannot end by its deadline, a few seconds before the cap.
    cmd = [sys.executable, "-m", "s24jax.perf.gpu_report.run_section", spec.name, "--jsonl", jsonl,
           "--deadline", repr(time.time() + cap - 3.0), "--files", files,
           *(["--smoke"] if smoke else [])]
    code, seconds = children.run(cmd, cwd=REPO, env=env, log_path=log, timeout=cap)
    if code is None:
      section.cut(f"its process was stopped at the section's cap of {cap:.0f} s; the rows "
                  "above are those that finished")
    elif code != 0:
      tail = children.tail(log, 1)
      section.failed("(section)", RuntimeError(
          f"its process exited with code {code} after {seconds:.0f} s: "
          f"{tail[0] if tail else 'no output'} (log: {log})"))
  print(f"[{spec.name}] done in {time.time() - (end - RESERVE - left):.0f} s", flush=True)
