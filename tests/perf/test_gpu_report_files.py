"""The GPU report's write path, on a CPU and in process (s24jax/perf/gpu_report/cli.py, files.py,
rows.py): a bad argument (a budget no section can start in, a name that is not a plain file
name, no or unknown sections) is one line and exit code 2 with every file as it was, an
earlier report included; `--markdown-from` writes only the markdown beside a report's record,
replacing only an earlier markdown of this command, never the input, a user's file, a file of
another kind, nor in a read-only folder; a full disk during the report or while writing the
markdown is one line and exit code 5, the rows recorded before whole, the markdown the last
one written and no temporary file left; a row is appended whole or not at all (a short write
on a full disk cut back), and `read` keeps every whole row around a cut line. The faults are
tests/faults.py's; trees are compared with its `snapshot`."""
import errno
import json
import os

import pytest

from s24jax.perf.gpu_report import cli
from s24jax.perf.gpu_report import files
from s24jax.perf.gpu_report import markdown
from s24jax.perf.gpu_report import rows

import faults

START = {"section": "report", "row": "start", "status": "ok", "command": "c", "budget": 30.0,
         "smoke": True, "sections": ["environment"]}
ENV = {"section": "environment", "row": "environment", "status": "ok", "device": "cpu"}


def _exit(argv, capsys):
  """(exit code, stderr) of the command: a return, or argparse's SystemExit."""
  try:
    code = cli.main(argv)
  except SystemExit as e:
    code = e.code
  return code, capsys.readouterr().err


def _earlier_report(out, name=cli.DEFAULT_NAME):
  """An earlier report of this command in `out`: its record, markdown and folder of logs."""
  jsonl, md, logs = files.paths(str(out), name)
  os.makedirs(logs)
  open(os.path.join(logs, files.LOGS_MARK), "w", encoding="utf-8").close()
  for row in (START, ENV):
    rows.append(jsonl, row)
  files.write_markdown(jsonl, md)
  return jsonl, md


def _one_line(code, err, want_code, *words):
  assert code == want_code and err.count("\n") == 1 and "Traceback" not in err, (code, err)
  for w in words:
    assert w in err, err


@pytest.mark.parametrize("argv, words", [
    (["--budget", "-5"], ["--budget", "-5 is below the minimum"]),
    (["--budget", "0"], ["--budget", "0 is below the minimum"]),
    (["--budget", "nan"], ["--budget", "not a finite number"]),
    (["--budget", "inf"], ["--budget", "not a finite number"]),
    (["--budget", str(cli.MIN_BUDGET - 1)], ["--budget", "below the minimum"]),
    (["--name", "../elsewhere"], ["--name", "not a plain file name"]),
    (["--name", ""], ["--name", "not a plain file name"]),
    (["--sections", ","], ["--sections", "no section given"]),
    (["--sections", "environment,gpus"], ["--sections", "unknown section(s) gpus"]),
])
def test_a_bad_argument_is_one_line_and_2_and_the_earlier_report_stays(argv, words, tmp_path,
                                                                       capsys, monkeypatch):
  out = tmp_path / "out"
  _earlier_report(out)
  before = faults.snapshot(tmp_path)
  monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("the report ran"))
  code, err = _exit(["--smoke", "--out", str(out), *argv], capsys)
  _one_line(code, err, 2, *words)
  assert faults.snapshot(tmp_path) == before


def _record(folder, name="r.jsonl", extra=()):
  path = folder / name
  for row in (START, ENV, *extra):
    rows.append(str(path), row)
  return path


@pytest.mark.parametrize("case", ["notes_beside", "the_input_itself", "a_link_to_the_input",
                                  "binary", "another_jsonl", "a_folder", "missing",
                                  "rows_of_another_kind", "readonly", "full"])
def test_markdown_from_writes_only_a_reports_markdown(case, tmp_path, capsys, monkeypatch):
  folder = tmp_path / "d"
  folder.mkdir()
  record = _record(folder)
  given, words = str(record), []
  if case == "notes_beside":
    (folder / "r.md").write_text("# my own notes\n")
    words = ["r.md exists and is not a GPU report's markdown"]
  elif case == "the_input_itself":
    given, words = str(_record(folder, "s.md")), ["over the record itself"]
  elif case == "a_link_to_the_input":
    (folder / "r.md").symlink_to(record)
    words = ["over the record itself"]
  elif case == "binary":
    (folder / "x.jsonl").write_bytes(bytes(range(128, 256)) * 8)
    given, words = str(folder / "x.jsonl"), ["not a GPU report's record", "not a JSON row"]
  elif case == "another_jsonl":
    (folder / "x.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    given, words = str(folder / "x.jsonl"), ["not a GPU report's start row"]
  elif case == "a_folder":
    given, words = str(folder), ["is a folder, not a GPU report's record"]
  elif case == "missing":
    given, words = str(folder / "none.jsonl"), ["does not exist"]
  elif case == "rows_of_another_kind":
    given = str(_record(folder, "k.jsonl", [{"section": "steps", "row": "x", "status": "ok",
                                             "step_ms": 3.0}]))
    words = ["a row of it is not a GPU report's"]
  before = faults.snapshot(tmp_path)
  with monkeypatch.context() as m:
    if case == "readonly":
      faults.Faults(m).readonly(str(folder))
      words = ["read-only"]
    if case == "full":
      faults.Faults(m).full(str(folder))
      words = ["no space left"]
    code, err = _exit(["--markdown-from", given], capsys)
  _one_line(code, err, 2, *words)
  assert faults.snapshot(tmp_path) == before


def test_markdown_from_replaces_an_earlier_markdown_of_its_record(tmp_path, capsys):
  """The report's own markdown beside the record (here of fewer rows) is rewritten from it."""
  record = _record(tmp_path)
  files.write_markdown(str(record), str(tmp_path / "r.md"))
  rows.append(str(record), {"section": "report", "row": "end", "status": "ok",
                            "reason": "every section ran or was skipped"})
  code, err = _exit(["--markdown-from", str(record)], capsys)
  assert code == 0, err
  md = (tmp_path / "r.md").read_text()
  assert md.startswith(markdown.TITLE) and "every section ran or was skipped" in md, md
  assert sorted(os.listdir(tmp_path)) == ["r.jsonl", "r.md"]


def test_a_full_disk_while_writing_the_markdown_is_one_line_and_5(tmp_path, capsys,
                                                                   monkeypatch):
  """The check passes (a full disk whose sync fails, as a delayed allocation does); the write
  then fails: exit 5, the earlier markdown as it was, no temporary file."""
  record = _record(tmp_path)
  files.write_markdown(str(record), str(tmp_path / "r.md"))
  rows.append(str(record), {"section": "report", "row": "end", "status": "ok", "reason": "x"})
  before = faults.snapshot(tmp_path)
  with monkeypatch.context() as m:
    faults.Faults(m).full(str(tmp_path), ops=("fsync",))
    code, err = _exit(["--markdown-from", str(record)], capsys)
  _one_line(code, err, 5, "no space left", "r.md", "as it was")
  assert faults.snapshot(tmp_path) == before


def test_a_full_disk_during_the_report_is_one_line_and_5(tmp_path, capsys, monkeypatch):
  """The disk fills during the second section (its row's write is short, then fails): exit 5,
  one line; the record holds the rows before it, each whole; the markdown is the one written
  after the first section; no temporary file is left."""
  out = tmp_path / "out"
  fault = faults.Faults(monkeypatch)
  ran = []

  def section(spec, names, end, jsonl, logs, env, smoke):   # in process: the fault reaches it
    ran.append(spec.name)
    if len(ran) == 2:
      fault.full(str(out), free_bytes=30)
    rows.Section(jsonl, spec.name).ok("a row", value=len(ran))
  monkeypatch.setattr(cli, "run_section", section)
  code, err = _exit(["--smoke", "--out", str(out), "--budget", "100", "--sections",
                     "environment,layouts,gemms"], capsys)
  _one_line(code, err, 5, "no space left", "--markdown-from")
  assert ran == ["environment", "layouts"]
  jsonl, md, _ = files.paths(str(out), cli.DEFAULT_NAME)
  with open(jsonl, "rb") as f:
    lines = f.read().split(b"\n")
  assert lines[-1] == b"" and [json.loads(l)["row"] for l in lines[:-1]] == ["start", "a row"]
  with open(md, encoding="utf-8") as f:
    text = f.read()
  assert text.startswith(markdown.TITLE) and "Not ended" in text, text
  left = [n for _, _, names in os.walk(out) for n in names]
  assert not [n for n in left if "tmp" in n], left


def test_a_row_is_appended_whole_or_not_at_all(tmp_path, monkeypatch):
  """A full disk with 30 bytes free (tests/faults.py: write(2) takes the part that fits, the
  next write fails): the row's bytes are cut back, the record as it was; the next row, once
  there is space, is whole and every row reads back. A new record that cannot take its first
  row is removed."""
  path = str(tmp_path / "r.jsonl")
  rows.append(path, START)
  before = (tmp_path / "r.jsonl").read_bytes()
  new = str(tmp_path / "new.jsonl")
  with monkeypatch.context() as m:
    fault = faults.Faults(m)
    fault.full(str(tmp_path), ops=("write",), free_bytes=30)
    with pytest.raises(OSError) as e:
      rows.append(path, ENV)
    assert e.value.errno == errno.ENOSPC and ("write", path) in fault.hits
    with pytest.raises(OSError):
      rows.append(new, START)
  assert (tmp_path / "r.jsonl").read_bytes() == before and not os.path.exists(new)
  rows.append(path, ENV)
  got = [{k: v for k, v in r.items() if k != "t"} for r in rows.read(path)]
  assert got == [START, ENV]


def test_read_keeps_every_whole_row_around_a_cut_line(tmp_path):
  """A record as a kill and an older version's append left it: a cut row with a whole row
  glued after it, a line that is not UTF-8, and a cut last line; `read` gives the whole rows
  in order, and the next append starts a line of its own."""
  line = lambda row: json.dumps(row).encode()   # noqa: E731
  other = {"section": "gemms", "row": "g", "status": "ok"}
  path = tmp_path / "r.jsonl"
  path.write_bytes(line(START) + b"\n" + line(ENV)[:25] + line(other) + b"\n"
                   + b"\xff\xfe not utf-8\n" + line(ENV)[:40])
  assert rows.read(str(path)) == [START, other]
  rows.append(str(path), ENV)
  got = [{k: v for k, v in r.items() if k != "t"} for r in rows.read(str(path))]
  assert got == [START, other, ENV]
  assert path.read_bytes().split(b"\n")[-3] == line(ENV)[:40]   # the cut line stays alone
