"""`python -m s24jax.cli.export` on bad input and against a second export to the same --out
(issue 41): a bad argument is one line and exit code 2, nothing written; of two exports to one
--out, the one that finishes second refuses (one line, exit code 3) and --out holds the first
one's export whole, nothing else left beside it. And the way back's messages
(training/init_from.py). The write faults: tests/cli/test_write_paths.py."""
from __future__ import annotations

import json
import os
import shutil

import jax
import pytest

from s24jax import errors
from s24jax.cli import export
from s24jax.data import tokenizer as tokenizer_lib
from s24jax.nn import hf_layouts
from s24jax.nn import model as model_lib
from s24jax.training import init_from
from s24jax.training import trained as trained_lib
from s24jax.training.run_spec import RunSpec

from faults import snapshot
from tiny import tiny_config


def _one_line(err: str, says: str) -> None:
  assert err.count("\n") == 1 and says in err and "Traceback" not in err, err
  assert err.startswith("s24jax.cli.export: "), err


def test_bad_arguments_are_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
  def no_work(*a, **k):
    raise AssertionError("the checkpoint was read before the arguments were checked")
  monkeypatch.setattr(trained_lib, "load_run", no_work)
  (tmp_path / "run").mkdir()
  (tmp_path / "a_file").write_text("mine")
  (tmp_path / "dangling").symlink_to(tmp_path / "unmounted")
  out = ["--out", str(tmp_path / "hf")]
  # (snapshot reads every file: the dangling link is looked at by name)
  before = sorted(os.listdir(tmp_path)), (tmp_path / "a_file").read_text()
  for argv, says in (
      (["--workdir", str(tmp_path / "a_file"), *out],
       f"argument --workdir: {tmp_path / 'a_file'} is a file, not a run's workdir"),
      (["--workdir", str(tmp_path / "dangling"), *out],
       f"{tmp_path / 'dangling'} is a symbolic link to {tmp_path / 'unmounted'}, which does "
       "not exist"),
      (["--workdir", str(tmp_path / "none"), *out], "none does not exist"),
      (["--workdir", str(tmp_path / "run"), *out, "--step", "-1"],
       "argument --step: -1 is below the minimum, 0"),
      (["--workdir", str(tmp_path / "run")], "the following arguments are required: --out")):
    with pytest.raises(SystemExit) as stop:
      export.main(argv)
    assert stop.value.code == errors.EXIT_USER, argv
    _one_line(capsys.readouterr().err, says)
    assert (sorted(os.listdir(tmp_path)), (tmp_path / "a_file").read_text()) == before, argv


def test_out_is_never_a_link(tmp_path, monkeypatch, capsys):
  """A link at --out (to an earlier export, or dangling: a disk not mounted) is the user's: an
  export would rename its folder over it. Refused, the link and its target as they were."""
  monkeypatch.setattr(trained_lib, "load_run", lambda *a: pytest.fail("the checkpoint was read"))
  (tmp_path / "run").mkdir()
  (tmp_path / "earlier").mkdir()
  (tmp_path / "earlier" / export.MARKER).write_text("{}")
  (tmp_path / "hf").symlink_to(tmp_path / "earlier")
  (tmp_path / "dangling").symlink_to(tmp_path / "unmounted")
  earlier = snapshot(tmp_path / "earlier")
  for link, says in ((tmp_path / "hf", f"is a symbolic link to {tmp_path / 'earlier'}: an export "
                                       "replaces a folder, never a link"),
                     (tmp_path / "dangling", f"is a symbolic link to {tmp_path / 'unmounted'}, "
                                             "which does not exist: an export replaces")):
    code = export.main(["--workdir", str(tmp_path / "run"), "--out", str(link), "--overwrite"])
    assert code == errors.EXIT_USER
    _one_line(capsys.readouterr().err, f"--out {link} {says}")
  assert os.readlink(tmp_path / "hf") == str(tmp_path / "earlier")
  assert os.readlink(tmp_path / "dangling") == str(tmp_path / "unmounted")
  assert snapshot(tmp_path / "earlier") == earlier
  assert sorted(os.listdir(tmp_path)) == ["dangling", "earlier", "hf", "run"]


@pytest.fixture(scope="module")
def bytes_model():
  """(model config, params, sparsity) of a tiny dense run on UTF-8 bytes (no tokenizer files
  to write: a quick export)."""
  spec = RunSpec.build(tiny_config("dense", overrides={"data.tokenizer": "bytes",
                                                       "model.vocab_size": 320}))
  state = jax.jit(spec.fresh_state)()
  return spec.model_cfg, state.params, state.sparsity


@pytest.mark.parametrize("earlier", [False, True])
def test_two_exports_to_one_out_never_both_succeed(bytes_model, tmp_path, monkeypatch, earlier):
  """A second export to the same --out runs to the end while the first is writing its
  weights: the first then refuses (OutChanged, exit code 3), --out is the second's export,
  byte for byte, and no temporary or set-aside folder is left. Also when --out held an
  earlier export both were allowed to replace (--overwrite)."""
  cfg, params, sparsity = bytes_model
  out = tmp_path / "hf"
  if earlier:
    export.write_hf_dir(out, cfg, params, sparsity, "bytes", {"which": "earlier"})
  real_save = export._save_safetensors
  second = {}

  def save_while_another_export_runs(state, path):
    if not second:                    # the first export's save: the second runs now, whole
      second["started"] = True
      export.write_hf_dir(out, cfg, params, sparsity, "bytes", {"which": "second"},
                          overwrite=earlier)
      second["snapshot"] = snapshot(out)
    real_save(state, path)
  monkeypatch.setattr(export, "_save_safetensors", save_while_another_export_runs)
  with pytest.raises(export.OutChanged, match="was written by another command") as refused:
    export.write_hf_dir(out, cfg, params, sparsity, "bytes", {"which": "first"},
                        overwrite=earlier)
  assert refused.value.exit_code == errors.EXIT_LOCKED
  assert snapshot(out) == second["snapshot"] and os.listdir(tmp_path) == ["hf"]
  assert json.loads((out / export.MARKER).read_text())["which"] == "second"


def test_the_command_says_so_in_one_line(undisturbed, tmp_path, monkeypatch, capsys):
  """Through the command line: the second to finish exits 3 with one line; the first's
  export stays."""
  out = tmp_path / "hf"
  argv = ["--workdir", undisturbed, "--out", str(out)]
  real_save, second = export._save_safetensors, {}

  def save_while_another_export_runs(state, path):
    if not second:                    # the first export's save: the second runs now, whole
      second["started"] = True
      second["code"], second["snapshot"] = export.main(argv), snapshot(out)
    real_save(state, path)
  monkeypatch.setattr(export, "_save_safetensors", save_while_another_export_runs)
  code = export.main(argv)
  assert second["code"] == errors.EXIT_OK and code == errors.EXIT_LOCKED
  _one_line(capsys.readouterr().err, f"--out {out} was written by another command while this "
                                     "export ran")
  assert snapshot(out) == second["snapshot"] and os.listdir(tmp_path) == ["hf"]


def test_init_from_names_the_field_and_what_is_there(tmp_path):
  """The way back (s24jax/training/init_from.py): a --config.init_from that is no Hugging Face
  directory is one line naming config.init_from and what is there (a UserError: exit code 2
  in launch.py, before anything is written)."""
  cfg = model_lib.model_config(tiny_config("dense"))
  on_bytes = model_lib.model_config(tiny_config("dense", overrides={"data.tokenizer": "bytes",
                                                                    "model.vocab_size": 320}))
  (tmp_path / "a_file").write_text("x")
  (tmp_path / "dangling").symlink_to(tmp_path / "unmounted")
  listed, index = tmp_path / "listed", tmp_path / "index"
  listed.mkdir()
  (listed / "config.json").write_text("[1, 2]")
  shutil.copytree(listed, index)
  # a bytes run's export (no tokenizer files), sharded, its index without the weight map
  (index / "config.json").write_text(json.dumps(hf_layouts.GPT2.config(on_bytes, 256)))
  (index / export.MARKER).write_text(json.dumps({"tokenizer": tokenizer_lib.ByteTokenizer().name}))
  (index / "model.safetensors.index.json").write_text('{"metadata": {}}')
  for path, says in (
      (tmp_path / "a_file", "is a file, not a folder: expected a local GPT2LMHeadModel"),
      (tmp_path / "dangling", f"is a symbolic link to {tmp_path / 'unmounted'}, which does not "
                              "exist"),
      (tmp_path / "none", "does not exist: expected a local GPT2LMHeadModel directory"),
      (listed, "its config.json holds a JSON list, not the object of a model's config"),
      (index, "model.safetensors.index.json has no weight_map")):
    with pytest.raises(errors.UserError) as refused:
      if path == index:
        init_from.read_hf_dir(path, on_bytes, "bytes")
      else:
        init_from.read_hf_dir(path, cfg, "gpt2")
    assert str(refused.value).startswith(f"config.init_from={path}") and says in str(refused.value)
