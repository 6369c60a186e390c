"""Tests for s24jax/errors.py: the user-error type (one line, a ValueError, `user_errors`
converting only what it is told to), the exit codes (distinct, carried by the error classes,
and every one in the README's table), and the command lines `python -m s24jax.cli.flops` and
`python -m s24jax.perf.plan` printing a user error as one line with exit code 2 (the planner's
argument errors before the compile plugin is looked for; a config file that cannot run),
called in process. launch.py's own: tests/cli/test_launch.py; every command's write paths:
tests/cli/test_write_paths.py."""
import os
import re

import pytest

from s24jax.training import checkpoint as ckpt_lib
from s24jax import errors
from s24jax.cli import command
from s24jax.cli import flops as flops_cli
from s24jax.training import loop
from s24jax.perf import plan
from s24jax.training import workdir as workdir_lib
from s24jax.kernels import aot


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODES = {name: getattr(errors, name) for name in dir(errors) if name.startswith("EXIT_")}


def test_user_errors_are_one_line_value_errors_and_only_the_named_types_convert():
  e = errors.UserError("config.optim.lr=-1:\n  must be   positive")
  assert str(e) == "config.optim.lr=-1: must be positive" and isinstance(e, ValueError)
  assert e.exit_code == errors.EXIT_USER
  with pytest.raises(errors.UserError, match="^data: bad folder$") as info:
    with errors.user_errors(FileNotFoundError, context="data: "):
      raise FileNotFoundError("bad folder")
  assert isinstance(info.value.__cause__, FileNotFoundError)   # kept for a debugger
  with pytest.raises(KeyError):   # not named: an internal error, left alone
    with errors.user_errors(ValueError):
      raise KeyError("x")
  with pytest.raises(ckpt_lib.CheckpointSaveError):   # a KnownError keeps its own type
    with errors.user_errors(RuntimeError):
      raise ckpt_lib.CheckpointSaveError("disk full")


def test_exit_codes_are_distinct_and_the_readme_table_lists_each():
  assert len(set(CODES.values())) == len(CODES), CODES
  assert (errors.EXIT_CRASH, errors.EXIT_USER) == (1, 2)   # Python's own, argparse's
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  section = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
  rows = {row.split("|")[1].strip(): row.split("|")[2] for row in section.splitlines()
          if row.startswith("| ") and not row.startswith("| command")}
  listed = {int(n) for cell in rows.values()
            for n in re.findall(r"(?:^|; |, )(\d+)", cell.strip())}
  assert listed == set(CODES.values()), (listed, CODES)
  for name_ in ("launch.py", "s24jax.perf.plan", "s24jax.cli.flops", "s24jax.perf.gpu_report"):
    assert any(name_ in name for name in rows), name_
  assert "6 it compiles but does not fit" in rows["`python -m s24jax.perf.plan`"]
  # The codes of the classes that carry them.
  assert loop.NonFiniteError("x").exit_code == errors.EXIT_NON_FINITE
  assert ckpt_lib.NoReadableCheckpointError("x").exit_code == errors.EXIT_STORAGE
  assert workdir_lib.WorkdirLockedError("x").exit_code == errors.EXIT_LOCKED
  assert isinstance(ckpt_lib.CheckpointMismatchError("x"), errors.UserError)


def test_flops_and_plan_name_the_bad_argument_in_one_line(capsys, monkeypatch, tmp_path):
  no_get_config = tmp_path / "no_get_config.py"
  no_get_config.write_text("from s24jax.training.config import base_config\n")
  crash = tmp_path / "crash.py"
  crash.write_text("def get_config(variant=None):\n  return {}['model']\n")
  for argv, named in ((["flops", "experiments/nope.py"], "config file 'experiments/nope.py'"),
                      (["flops", "experiments/gpt2_ste.py:tiny", "optim.lr=-1"],
                       "config.optim.lr=-1.0"),
                      (["flops", "experiments/gpt2_ste.py:tiny", "model.d_modle=1"],
                       "did you mean model.d_model"),
                      (["flops", str(no_get_config)], f"{no_get_config} defines no get_config"),
                      (["flops", str(crash)], f"raised KeyError: 'model' (at {crash}:2)")):
    code = command.run(flops_cli.main, argv[1:], name="s24jax.cli.flops")
    assert code == errors.EXIT_USER
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "Traceback" not in err, err

  def no_plugin():
    raise aot.PluginMissing("the CUDA compile plugin is missing (a test's)")

  # The plugin missing: every argument and config error is still the one said (they come
  # first), never the plugin's.
  monkeypatch.setattr(aot, "check_plugin", no_plugin)
  cases = ((["--config", "experiments/nope.py"], "config file 'experiments/nope.py'"),
           (["--config", "experiments/gpt2_ste.py:tiny", "--gpu", "v100"], "--gpu: invalid choice: 'v100'"),
           (["--config", "experiments/gpt2_ste.py:tiny", "--devices", "0"], "--devices: 0 is below"),
           (["--config", "experiments/gpt2_ste.py:tiny", "--set", "batch_size=0"],
            "config.batch_size=0"),
           (["--config", "experiments/gpt2_ste.py:tiny", "--set", "nope=1"], "override 'nope'"))
  for argv, named in cases:
    try:
      code = plan.main(argv)
    except SystemExit as e:   # an argument's check (argparse, command.Parser: one line)
      code = e.code
    assert code == errors.EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith("s24jax.perf.plan: ") and named in err and err.count("\n") == 1, err
    assert "plugin" not in err, err
