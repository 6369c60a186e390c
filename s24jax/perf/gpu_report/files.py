"""The report's files in its folder (--out): NAME.jsonl (the record, rows.py), NAME.md (its
markdown, markdown.py) and the folder NAME/ (logs, probes). Which of them are this command's
own, recognised by their content (a record starts with the report's start row, a markdown
with markdown.TITLE, the folder holds LOGS_MARK): a new report replaces those and refuses
anything else of the same name (`check_out`, before anything runs). The markdown is written
whole or not at all, from the record, during a report (`write_markdown`) or later
(`markdown_from`: never over the record itself nor a file that is not a report's markdown).
"""
from __future__ import annotations

import json
import os

from s24jax import destinations
from s24jax import errors
from s24jax.perf import outputs
from s24jax.perf.gpu_report import markdown
from s24jax.perf.gpu_report import rows

# In the report's folder of logs: the folder is the report's, which a new report replaces.
LOGS_MARK = ".s24jax_gpu_report"
RECORD, MARKDOWN = "a GPU report's record (NAME.jsonl)", "a GPU report's markdown"


def paths(out: str, name: str) -> tuple[str, str, str]:
  """The record, the markdown and the folder of logs of report `name` in `out`."""
  return tuple(os.path.join(out, name + ext) for ext in (".jsonl", ".md", ""))


def not_a_record(path: str) -> str | None:
  """None if `path` is a report's record (its first line the start row), else why not."""
  try:
    with open(path, "rb") as f:
      first = f.readline(1 << 20)
  except OSError as e:
    return f"it cannot be read ({e.strerror})"
  try:
    row = json.loads(first.decode("utf-8"))
  except ValueError:   # UnicodeDecodeError is one
    return "its first line is not a JSON row (a binary file, or another kind of file?)"
  if not (isinstance(row, dict) and row.get("section") == "report" and row.get("row") == "start"):
    return "its first line is not a GPU report's start row (another JSONL format?)"
  return None


def is_record(path: str) -> bool:
  return not_a_record(path) is None


def is_markdown(path: str) -> bool:
  """Whether `path` is a markdown this command wrote (its first line the title)."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.readline().rstrip("\n") == markdown.TITLE
  except (OSError, UnicodeDecodeError):
    return False


def check_out(out: str, name: str) -> None:
  """Before anything runs: the report's folder writable, and what the report replaces (its
  .jsonl, .md and folder of logs from an earlier run) its own; anything else of that name is
  left as it is and refused (DestinationError: one line, exit 2)."""
  jsonl, md, logs = paths(out, name)
  destinations.check_file(jsonl, what=RECORD, flag="--out/--name", replaces=is_record)
  destinations.check_file(md, what=MARKDOWN, flag="--out/--name", replaces=is_markdown)
  if os.path.lexists(logs) and not (os.path.isdir(logs) and
                                    os.path.exists(os.path.join(logs, LOGS_MARK))):
    raise destinations.DestinationError(
        f"--out/--name {logs} exists and is not a GPU report's folder of logs: it is left as "
        "it is; choose another --out or --name (nothing was written)")


def write_markdown(jsonl: str, md: str) -> None:
  """The markdown of the record `jsonl`, written whole over `md` (only ever the report's own:
  a DestinationError otherwise). OSError on a failed write (`md` as it was)."""
  destinations.write_atomic(md, markdown.render(rows.read(jsonl)), replaces=is_markdown,
                            what=MARKDOWN)


def markdown_from(jsonl: str) -> str:
  """`--markdown-from`: the markdown of the record `jsonl` (args.input_file checked it is one)
  rewritten beside it (NAME.md for NAME.jsonl); its path. Never over the record itself nor a
  file of that name that is not a report's markdown (UserError, nothing written); a failed
  write is one line (exit code 5), the file as it was."""
  md = os.path.splitext(jsonl)[0] + ".md"
  if os.path.exists(md) and os.path.samefile(md, jsonl):
    raise errors.UserError(f"--markdown-from {jsonl}: its markdown would be written over the "
                           f"record itself ({md}); name the record NAME.jsonl (nothing was "
                           "written)")
  destinations.check_file(md, what=MARKDOWN, flag="--markdown-from", replaces=is_markdown)
  try:
    text = markdown.render(rows.read(jsonl))
  except (KeyError, TypeError, ValueError, AttributeError) as e:   # a row of another kind
    raise errors.UserError(f"--markdown-from {jsonl}: a row of it is not a GPU report's "
                           f"({rows.error_line(e)}); nothing was written") from e
  outputs.write(md, text, what="the markdown", replaces=is_markdown,
                intact="The file is as it was")
  return md
