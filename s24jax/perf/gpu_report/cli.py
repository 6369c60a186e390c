"""The command line of `python -m s24jax.perf.gpu_report` (the package docstring says what it
does), on the error path every command shares (s24jax/cli/command.py).

Before anything runs: every argument (a budget in which a section can start, known sections,
a plain file name, a record to rebuild the markdown from: args.py's checks) and the places
the report writes (files.check_out): a problem is one line and exit code 2, nothing written.
Each section runs in a child process with its cap (sections.py); the record (rows.py) is
appended as rows end, and the markdown is rewritten from it after every section and at the
end, also when the report is stopped (SIGTERM, Ctrl-C: the running child is ended first).
Exit 0 when the report ran, whatever its rows say (a failed row is a finding); 2 off a GPU
without --smoke or on a bad argument; 5 when a write fails during the report (a full disk, the
folder made read-only): one line, the rows recorded before it whole, the markdown the last
one written, no temporary file; 75 when stopped by SIGTERM / SIGINT (its markdown written
from what finished; while starting: nothing written).
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
from s24jax.cli import args as cli_args
from s24jax.cli import command
from s24jax.perf.gpu_report import children
from s24jax.perf.gpu_report import files
from s24jax.perf.gpu_report import markdown
from s24jax.perf.gpu_report import rows
from s24jax.perf.gpu_report import sections as sections_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NAME = "s24jax.perf.gpu_report"
EXIT_NO_GPU = errors.EXIT_USER
DEFAULT_BUDGET = 420.0     # seconds: a GPU host lent for 10 minutes, less ~1 minute of set-up
DEFAULT_NAME = "gpu_report_latest"
RESERVE = 8.0              # seconds kept at the end: ending a child, the last markdown
# Below this no section can start: a report of nothing would replace the last one.
MIN_BUDGET = RESERVE + min(s.minimum for s in sections_lib.SECTIONS)


class Stopped(Exception):
  """The report received a signal."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def _raise(signum, frame):
  del frame
  raise Stopped(signum)


def _sections(text: str) -> tuple[str, ...]:
  """--sections: known names, at least one, in the report's order."""
  names = [n for n in text.split(",") if n]
  unknown = [n for n in names if n not in sections_lib.BY_NAME]
  if unknown or not names:
    raise argparse.ArgumentTypeError(
        f"{'unknown section(s) ' + ', '.join(unknown) if unknown else 'no section given'}; "
        f"valid: {', '.join(sections_lib.BY_NAME)}")
  return tuple(s.name for s in sections_lib.SECTIONS if s.name in names)


def _file_name(text: str) -> str:
  """--name: a plain file name (the report's files go into --out, nowhere else)."""
  if text in ("", ".", "..") or os.sep in text or (os.altsep and os.altsep in text):
    raise argparse.ArgumentTypeError(f"{text!r} is not a plain file name (the report writes "
                                     "NAME.md, NAME.jsonl and the folder NAME/ in --out)")
  return text


def _parser() -> argparse.ArgumentParser:
  p = command.Parser(prog=f"python -m {NAME}", description="GPU evidence in one time-capped run.")
  p.add_argument("--budget", type=cli_args.number(minimum=MIN_BUDGET), default=DEFAULT_BUDGET,
                 help=f"seconds for the whole report (default {DEFAULT_BUDGET:.0f}; at least "
                      f"{MIN_BUDGET:.0f}, in which the first section can start)")
  p.add_argument("--out", default=os.path.join(REPO, "docs"), help="folder of the report")
  p.add_argument("--name", type=_file_name, default=DEFAULT_NAME,
                 help="file names: NAME.md, NAME.jsonl and the folder NAME/ (logs)")
  p.add_argument("--sections", type=_sections,
                 default=",".join(s.name for s in sections_lib.SECTIONS),
                 help="comma-separated, in the report's order")
  p.add_argument("--smoke", action="store_true",
                 help="a CPU check of the script: tiny shapes, the cuSPARSELt stand-in")
  p.add_argument("--markdown-from", metavar="JSONL",
                 type=cli_args.input_file(files.RECORD, kind=files.not_a_record),
                 help="only rewrite the markdown of this record (beside it) and exit")
  return p


def main(argv=None) -> int:
  """The command's exit code (the module docstring)."""
  return command.run(_main, argv, name=NAME)


def _main(argv) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _parser().parse_args(argv)
  if args.markdown_from:
    print(f"wrote {files.markdown_from(args.markdown_from)}")
    return errors.EXIT_OK
  files.check_out(args.out, args.name)
  start = time.time()
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # share the GPU
  import jax  # pylint: disable=g-import-not-at-top  (after the allocator setting)
  if jax.default_backend() != "gpu" and not args.smoke:
    raise errors.UserError(
        f"no GPU here (jax.default_backend() = {jax.default_backend()!r}): the report is GPU "
        "evidence. Run it on a GPU host, or with --smoke for a CPU check of the script.")
  return run(args, args.sections, start, shlex.join(["python", "-m", NAME, *argv]))


def pinned_cusparselt() -> str:
  """The cuSPARSELt version the repository pins, or 'unknown: why' (the report still runs)."""
  from s24jax.kernels.cusparselt import library  # pylint: disable=g-import-not-at-top  (jax)
  try:
    return library.pinned_version()
  except ValueError as e:
    return f"unknown: {e}"


def _begin(args, names: tuple[str, ...], command_line: str) -> None:
  """The earlier report's files replaced by the new report's start (files.check_out found
  them the report's own): its folder of logs, marked, and the record's start row."""
  jsonl, md, logs = files.paths(args.out, args.name)
  os.makedirs(args.out, exist_ok=True)
  for old in (jsonl, md):
    if os.path.exists(old):
      os.remove(old)
  shutil.rmtree(logs, ignore_errors=True)
  os.makedirs(logs)
  open(os.path.join(logs, files.LOGS_MARK), "x", encoding="utf-8").close()
  rows.append(jsonl, {"section": "report", "row": "start", "status": "ok",
                      "command": command_line, "budget": args.budget, "smoke": args.smoke,
                      "sections": list(names), "cusparselt_pinned": pinned_cusparselt()})


def _finish(jsonl: str, md: str, reason: str, start: float, out: str) -> OSError | None:
  """The record's end row and the markdown; the write error that stopped them, if any."""
  try:
    rows.append(jsonl, {"section": "report", "row": "end", "status": "ok", "reason": reason,
                        "seconds": round(time.time() - start, 1)})
    files.write_markdown(jsonl, md)
  except OSError as e:
    if not destinations.is_write_error(e, under=out):
      raise
    return e
  return None


def run(args, names: tuple[str, ...], start: float, command_line: str) -> int:
  jsonl, md, logs = files.paths(args.out, args.name)
  with destinations.writing(f"the GPU report in {args.out}", "The earlier report there was "
                            "removed (a new report replaces it); nothing of this one was "
                            "recorded", under=args.out):
    _begin(args, names, command_line)
  os.environ[rows.ENV_T0] = repr(start)
  env = dict(os.environ, **{rows.ENV_JSONL: jsonl, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  if args.smoke:
    env["JAX_PLATFORMS"] = "cpu"
  end = start + args.budget
  old_handlers = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGINT)}
  reason, code, warned, failed = "every section ran or was skipped", 0, None, None
  try:
    for i, name in enumerate(names):
      run_section(sections_lib.BY_NAME[name], names[i:], end, jsonl, logs, env, args.smoke)
      files.write_markdown(jsonl, md)
      warned = warned or print_warning(jsonl)
  except Stopped as e:
    reason, code = f"stopped by {e}", errors.EXIT_PREEMPTED
  except OSError as e:
    reason = f"stopped: a write failed ({destinations.reason(e)})"
    if not destinations.is_write_error(e, under=args.out):
      reason = f"stopped by an internal error ({rows.error_line(e)})"
      raise
    failed = e
  except BaseException as e:
    reason = f"stopped by an internal error ({rows.error_line(e)})"
    raise
  finally:
    for s, h in old_handlers.items():
      signal.signal(s, h)
    end_failed = _finish(jsonl, md, reason, start, args.out)
    failed = failed or end_failed   # the first write error is the one said
  if failed is not None:
    raise destinations.write_failed(failed, f"the GPU report in {args.out}", (
        f"Every row recorded before it is whole in {jsonl} and {md} is the markdown last "
        f"written (no partial file); {destinations.remedy(failed)} and rebuild the markdown "
        f"with python -m {NAME} --markdown-from {jsonl}"))
  print(f"{NAME}: {reason} in {time.time() - start:.0f} s of {args.budget:.0f}; "
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
                logs: str, env: dict, smoke: bool) -> None:
  section = rows.Section(jsonl, spec.name)
  left = end - RESERVE - time.time()
  cap = sections_lib.cap(spec.name, left, names)
  if cap < spec.minimum:
    section.skipped("(section)", f"budget: {max(cap, 0):.0f} s for it of {max(left, 0):.0f} s "
                    f"left; it needs at least {spec.minimum:.0f} s")
    print(f"[{spec.name}] skipped for the budget", flush=True)
    return
  log = os.path.join(logs, spec.name + ".log")
  print(f"[{spec.name}] up to {cap:.0f} s", flush=True)
  if spec.pytest:
    cmd, extra = sections_lib.pytest_command(spec.name, smoke, logs)
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
           "--deadline", repr(time.time() + cap - 3.0), "--files", logs,
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
