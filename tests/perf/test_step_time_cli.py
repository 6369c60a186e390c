"""`python -m s24jax.perf.step_time` on the error path every command shares (s24jax/perf/step_time/
cli.py): every bad argument, config or file is one line and exit code 2 before anything is
compiled or written (numbers in range, files of the right kind: a census file, HLO text);
`report --json` / `predict --out` never replace the calibration (nor any file but a
predictions file); `--save` / `--json` into a folder that does not exist make it; and the
census of HLO text read from a file or an XLA dump folder. In process: these are the
command's own checks (the process's exit code and Ctrl-C: tests/perf/test_commands.py)."""
import hashlib
import json
import os
import shutil

import pytest

from s24jax.perf import step_census as sc
from s24jax.perf.step_time import calibration as cal
from s24jax.perf.step_time import cli
from s24jax.perf.step_time import predict

import faults
import test_step_census   # the hand-written HLO module (tests/perf/ is on sys.path)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERIMENTS = os.path.join(REPO, "experiments")
HLO = test_step_census.HLO


def _exit(argv, capsys):
  """(exit code, stderr) of the command: a return, or argparse's SystemExit."""
  try:
    code = cli.main(argv)
  except SystemExit as e:
    code = e.code
  return code, capsys.readouterr().err


def _sha(path) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("argv, message", [
    (["census", "--config", os.path.join(EXPERIMENTS, "no_such_file.py:124m")], "not found"),
    (["census", "--config", os.path.join(EXPERIMENTS, "gpt2_dense.py:no_such")], "variant"),
    (["census"], "--config or --hlo"),
    (["census", "--hlo", "x.txt", "--kernels", "-1"], "-1 is below the minimum, 0"),
    (["census", "--config", os.path.join(EXPERIMENTS, "gpt2_dense.py:tiny"), "--micro", "0"],
     "0 is below the minimum, 1"),
    (["census", "--hlo", "x.txt", "--gpu", "h900"], "invalid choice: 'h900'"),
    (["report", "--rows", "124m,9000m"], "9000m"),
    (["predict", "--out", "never_written.json", "--rows", "9000m"], "9000m"),
    (["report", "--rows", "", "--calibration", "/no/such/calibration.json"], "does not exist"),
    (["predict", "--out", "never_written.json", "--rows", "124m", "--config",
      os.path.join(EXPERIMENTS, "gpt2_dense.py:tiny")], "not both"),
    (["predict", "--out", str(cal.CALIBRATION), "--rows", "124m"],
     "not a step-model predictions file"),
    (["report", "--rows", "", "--json", str(cal.CALIBRATION)],
     "not a step-model predictions file"),
])
def test_a_bad_command_is_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)   # where a relative path would be written: nothing is
  before = _sha(cal.CALIBRATION)
  code, err = _exit(argv, capsys)
  assert code == 2 and err.count("\n") == 1 and message in err, err
  assert "step_time" in err.split(":")[0] and "Traceback" not in err, err
  assert os.listdir(tmp_path) == [] and _sha(cal.CALIBRATION) == before


def _files(tmp_path):
  """Files of the wrong kind (name -> path) and what the command must say of each."""
  binary = tmp_path / "noise.bin"
  binary.write_bytes(bytes(range(128, 256)) * 4)
  notes = tmp_path / "notes.md"
  notes.write_text("# my notes\n\nnot HLO\n")
  entry = HLO.index("ENTRY")
  cut = tmp_path / "cut.txt"                  # a dump cut short inside its ENTRY computation
  cut.write_text(HLO[:HLO.index("\n", HLO.index("\n", entry) + 1) + 1])
  header = HLO.index("%gemm_computation")     # a module missing a computation it calls
  missing = tmp_path / "missing.txt"
  missing.write_text(HLO[:header] + HLO[HLO.index("}\n", header) + 2:])
  return binary, notes, cut, missing


@pytest.mark.parametrize("case", ["calibration_binary", "calibration_folder",
                                  "calibration_predictions", "hlo_notes", "hlo_binary",
                                  "hlo_cut", "hlo_missing_computation", "cache_a_file",
                                  "save_onto_notes"])
def test_a_file_of_the_wrong_kind_is_one_line_and_exit_2(case, tmp_path, capsys):
  binary, notes, cut, missing = _files(tmp_path)
  predictions = os.path.join(REPO, "docs", "step_model_predictions.json")
  argv, message = {
      "calibration_binary": (["report", "--rows", "", "--calibration", str(binary)],
                             "is not a census file: not JSON"),
      "calibration_folder": (["report", "--rows", "", "--calibration", str(tmp_path)],
                             "is a folder, not a census file"),
      "calibration_predictions": (["report", "--rows", "", "--calibration", predictions],
                                  f'not a JSON object with "format": "{cal.CENSUS_FORMAT}"'),
      "hlo_notes": (["census", "--hlo", str(notes)], "not optimized HLO text: no ENTRY"),
      "hlo_binary": (["census", "--hlo", str(binary)], "not text"),
      "hlo_cut": (["census", "--hlo", str(cut)], "ends inside computation"),
      "hlo_missing_computation": (["census", "--hlo", str(missing)],
                                  "calls 'gemm_computation', which the text does not hold"),
      "cache_a_file": (["census", "--hlo", str(notes), "--cache", str(notes)],
                       "is a file, not a folder"),
      "save_onto_notes": (["census", "--hlo", str(notes), "--save", str(notes), "--name", "x"],
                          "exists and is not a step-model census file"),
  }[case]
  before = faults.snapshot(tmp_path)
  code, err = _exit(argv, capsys)
  assert code == 2 and err.count("\n") == 1 and message in err, err
  assert "Traceback" not in err and faults.snapshot(tmp_path) == before


def test_report_json_never_replaces_the_calibration_and_makes_its_folder(tmp_path, capsys):
  """`report --json` onto the calibration (its copy given as --calibration, or the committed
  file) is refused, the file unchanged; into a folder that does not exist, the folder is made
  and the file written is a predictions file of that calibration."""
  copy = tmp_path / "calibration.json"
  shutil.copyfile(cal.CALIBRATION, copy)
  before, committed = _sha(copy), _sha(cal.CALIBRATION)
  for target in (copy, cal.CALIBRATION):
    code, err = _exit(["report", "--rows", "", "--calibration", str(copy), "--json",
                       str(target)], capsys)
    assert code == 2 and "not a step-model predictions file" in err, err
  assert _sha(copy) == before and _sha(cal.CALIBRATION) == committed
  out = tmp_path / "new" / "deeper" / "predictions.json"
  code, err = _exit(["report", "--rows", "", "--calibration", str(copy), "--json", str(out)],
                    capsys)
  assert code == 0, err
  written = json.loads(out.read_text())
  assert written["format"] == predict.FORMAT and written["rows"] == []
  assert written["inputs"]["files"] and _sha(copy) == before


def test_census_of_an_xla_dump_folder_saved_into_a_new_folder(tmp_path, capsys):
  """`census --hlo DIR` reads the step's after-optimizations dump (XLA_FLAGS=--xla_dump_to),
  e.g. from a GPU host: the hand-written module of tests/perf/test_step_census.py. `--save`
  into a folder that does not exist makes it; a second --save adds its row, keeping the
  first; the rows are the census's kernels (cal.compact)."""
  dump = tmp_path / "dump"
  dump.mkdir()
  (dump / "module_0001.jit_train_step.sm_9.0_gpu_after_optimizations.txt").write_text(HLO)
  saved = tmp_path / "censuses" / "new" / "c.json"
  assert cli.main(["census", "--hlo", str(dump), "--kernels", "3", "--save", str(saved),
                   "--name", "first"]) == 0
  out = capsys.readouterr().out
  assert "| dense GEMM | 2 / " in out and "| sparse GEMM | 1 / " in out
  assert cli.main(["census", "--hlo", str(dump), "--save", str(saved), "--name", "second"]) == 0
  data = json.loads(saved.read_text())
  assert data["format"] == cal.CENSUS_FORMAT and list(data["rows"]) == ["first", "second"]
  want = json.loads(json.dumps(cal.compact(sc.census(HLO))))   # tuples as JSON lists
  assert all(row["kernels"] == want for row in data["rows"].values())
  assert cli.main(["census", "--hlo", str(tmp_path / "missing")]) == 2
