"""s24jax/cli/compare.py against a run it must not reuse (issue 41): `run_all` reuses a run
already in an arm's workdir only if that run was made with the arm's config, checked for every
arm before any run starts; a run of another config (an earlier --steps) stops it with one line
naming the fields, nothing run or changed. And script_main's --steps is a count. (ROOT/table.md:
tests/cli/test_write_paths.py.)"""
from __future__ import annotations

import shutil

import pytest

from s24jax import errors
from s24jax.cli import compare
from s24jax.training import loop

from faults import snapshot
from train_helpers import STEPS


@pytest.fixture
def root(undisturbed, data_cache, tmp_path, monkeypatch):
  """A comparison root holding the session's finished run as arm 'a', the config file it was
  made with (tests/train_helpers.run_config), and no training (a test that trains fails)."""
  shutil.copytree(undisturbed, tmp_path / "root" / "a")
  (tmp_path / "cfg.py").write_text(
      "import train_helpers\n\n\ndef get_config(variant=None):\n"
      f"  return train_helpers.run_config({data_cache!r})\n")

  def no_training(*a, **k):
    raise AssertionError("a run was trained")
  monkeypatch.setattr(loop, "train_and_evaluate", no_training)
  return tmp_path


def test_a_run_of_another_config_is_not_tabulated(root):
  before = snapshot(root)
  arms = [compare.Arm("b", str(root / "cfg.py")),   # new: would train, but is checked after 'a'
          compare.Arm("a", str(root / "cfg.py"), {"total_steps": STEPS + 1})]
  with pytest.raises(errors.UserError) as refused:
    compare.run_all(arms, str(root / "root"), log=lambda *a: None)
  text = str(refused.value)
  assert f"{root / 'root' / 'a'} holds a run of another config" in text, text
  assert f"total_steps: {STEPS} there, {STEPS + 1} asked" in text and "\n" not in text
  assert snapshot(root) == before


def test_a_run_of_the_same_config_is_reused(root):
  table = compare.run_all([compare.Arm("a", str(root / "cfg.py"))], str(root / "root"))
  assert table.splitlines()[2].startswith("| a |") and "(cached)" in table


def test_a_bad_override_names_its_arm(root):
  with pytest.raises(errors.UserError, match="run 'a': .*total_steps"):
    compare.run_all([compare.Arm("a", str(root / "cfg.py"), {"total_steps": -1})],
                    str(root / "root"))


def test_steps_is_a_count(tmp_path, capsys):
  with pytest.raises(SystemExit) as stop:
    compare.script_main("a comparison", [compare.Arm("a", "unused.py")], str(tmp_path),
                        argv=["--steps", "-2"])
  err = capsys.readouterr().err
  assert stop.value.code == errors.EXIT_USER and err.count("\n") == 1, err
  assert "argument --steps: -2 is below the minimum, 0" in err and not list(tmp_path.iterdir())


def test_where_a_run_keeps_its_files_does_not_make_it_another_run(root, tmp_path):
  """data.cache_dir says where the tokens are cached, not what is trained (WHERE_NOT_WHAT):
  a run made with another cache folder is reused; a field that changes the run is not."""
  other = {"data.cache_dir": str(tmp_path / "another_cache")}
  table = compare.run_all([compare.Arm("a", str(root / "cfg.py"), other)], str(root / "root"))
  assert "(cached)" in table
  with pytest.raises(errors.UserError, match="seed"):
    compare.run_all([compare.Arm("a", str(root / "cfg.py"), {"seed": 12345})],
                    str(root / "root"))
