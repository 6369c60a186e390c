"""s24jax/cli/command.py and args.py: the one error path every command shares (exit codes,
one line, Ctrl-C from the first instant) and the shared argument checks."""
import argparse
import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from s24jax import errors
from s24jax.cli import args
from s24jax.cli import command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(main, capsys):
  code = command.run(main, [], name="s24jax-test")
  return code, capsys.readouterr().err


def test_each_kind_of_stop_is_one_line_and_its_exit_code(capsys):
  def user(argv):
    raise errors.UserError("config.x=3: must be\n  below 2")
  code, err = _run(user, capsys)
  assert code == errors.EXIT_USER and err == "s24jax-test: config.x=3: must be below 2 (exit code 2)\n"

  def full_disk(argv):
    raise OSError(errno.ENOSPC, "No space left on device", "/data/report.md")
  code, err = _run(full_disk, capsys)
  assert code == errors.EXIT_STORAGE and err.count("\n") == 1
  assert "/data/report.md" in err and "the disk is full" in err and "intact" in err

  def interrupted(argv):
    raise KeyboardInterrupt
  code, err = _run(interrupted, capsys)
  assert code == errors.EXIT_PREEMPTED and err.count("\n") == 1 and "SIGINT" in err

  def bug(argv):
    return {}["missing"]
  code, err = _run(bug, capsys)
  assert code == errors.EXIT_CRASH and "Traceback" in err and "KeyError" in err

  assert command.run(lambda argv: None, [], name="x") == errors.EXIT_OK
  assert command.run(lambda argv: 6, [], name="x") == 6


def test_a_read_error_is_not_called_a_write_failure(capsys):
  def missing(argv):
    raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/nowhere/x.json")
  with pytest.raises(FileNotFoundError):   # not a write: a bug's traceback, not exit 5
    command.run(missing, [], name="x")


def test_parser_errors_are_one_line(capsys):
  p = command.Parser(prog="python -m s24jax.cli.demo")
  p.add_argument("--budget", type=args.number(above=0), required=True)
  with pytest.raises(SystemExit) as e:
    p.parse_args(["--budget", "nan"])
  err = capsys.readouterr().err
  assert e.value.code == errors.EXIT_USER and err.count("\n") == 1, err
  assert "--budget" in err and "'nan' is not a finite number" in err, err


@pytest.mark.parametrize("text,error", [("-5", "must be greater than 0"), ("0", "greater than 0"),
                                        ("inf", "not a finite"), ("x", "not a number")])
def test_number_refuses_what_no_budget_is(text, error):
  with pytest.raises(argparse.ArgumentTypeError, match=error):
    args.number(above=0)(text)
  assert args.number(above=0)("420") == 420.0


def test_integer_range():
  parse = args.integer(minimum=1)
  assert parse("3") == 3
  with pytest.raises(argparse.ArgumentTypeError, match="below the minimum, 1"):
    parse("-2")
  with pytest.raises(argparse.ArgumentTypeError, match="not an integer"):
    parse("2.5")


def test_files_and_folders_of_the_wrong_kind(tmp_path):
  folder, file = tmp_path / "d", tmp_path / "f.json"
  folder.mkdir()
  file.write_text("{}")
  link = tmp_path / "dangling"
  link.symlink_to(tmp_path / "gone")
  as_file = args.input_file("a report", kind=lambda p: None if p.endswith(".json") else "no")
  assert as_file(str(file)) == str(file)
  with pytest.raises(argparse.ArgumentTypeError, match="is a folder, not a report"):
    as_file(str(folder))
  with pytest.raises(argparse.ArgumentTypeError, match="symbolic link to .*gone.*not exist"):
    as_file(str(link))
  as_folder = args.input_folder("a workdir")
  with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a workdir"):
    as_folder(str(file))
  with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
    as_folder(str(tmp_path / "none"))


def test_an_output_file_replaces_only_the_commands_own(tmp_path):
  own, user = tmp_path / "own.json", tmp_path / "notes.json"
  own.write_text('{"report": 1}')
  user.write_text("my notes")
  out = args.output_file("a report", "--json", replaces=lambda p: "report" in open(p).read())
  assert out(str(own)) == str(own)
  with pytest.raises(argparse.ArgumentTypeError, match="exists and is not a report"):
    out(str(user))
  assert user.read_text() == "my notes"
  assert out(str(tmp_path / "new" / "r.json"))            # a folder that can be made
  with pytest.raises(argparse.ArgumentTypeError, match="is a folder"):
    out(str(tmp_path))


@pytest.mark.slow
def test_ctrl_c_while_starting_is_one_line_and_75(tmp_path):
  """A command interrupted during its imports (here: jax's) stops with one line, exit 75."""
  script = ("from s24jax.cli import command\ncommand.guard_startup('demo')\n"
            "import sys; sys.stdout.write('guarded\\n'); sys.stdout.flush()\n"
            "import time\nimport jax, flax, optax\ntime.sleep(30)\n")
  proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  assert proc.stdout.readline() == "guarded\n"
  time.sleep(0.2)                                        # inside the heavy imports
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == errors.EXIT_PREEMPTED, (out, err)
  assert err.count("\n") == 1 and "Traceback" not in err and "nothing was written" in err, err
