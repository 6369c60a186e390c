"""s24jax/perf/outputs.py, how the perf tools write the file asked for: a folder that does not
exist is made; an existing file only if it is the tool's own output; a write that fails (a
full disk, a read-only folder) is one line with exit code 5 and what is intact, the earlier
file as it was and no temporary file left (tests/faults.py)."""
import pytest

from s24jax import destinations
from s24jax import errors
from s24jax.perf import outputs

import faults

def OURS(path) -> bool:   # pylint: disable=invalid-name  (the tool's `replaces` test)
  with open(path, encoding="utf-8") as f:
    return f.read().startswith("ours")


def _write(path, text="ours: new"):
  outputs.write(str(path), text, what="the report", replaces=OURS, intact="INTACT")


def test_a_missing_folder_is_made_and_only_its_own_file_replaced(tmp_path):
  path = tmp_path / "a" / "b" / "r.txt"
  _write(path)
  assert path.read_text() == "ours: new"
  _write(path, "ours: newer")                         # its own earlier output: replaced
  assert path.read_text() == "ours: newer"
  notes = tmp_path / "notes.txt"
  notes.write_text("my notes")
  with pytest.raises(destinations.DestinationError, match="exists and is not the report"):
    _write(notes)
  assert notes.read_text() == "my notes"


@pytest.mark.parametrize("fault", ["full", "full_sync", "readonly"])
def test_a_failed_write_is_one_line_and_5_and_the_file_stays(fault, tmp_path, monkeypatch):
  path = tmp_path / "r.txt"
  path.write_text("ours: earlier")
  before = faults.snapshot(tmp_path)
  with monkeypatch.context() as m:
    f = faults.Faults(m)
    if fault == "readonly":
      f.readonly(str(tmp_path))
    else:
      f.full(str(tmp_path), **({"ops": ("fsync",)} if fault == "full_sync" else
                               {"free_bytes": 3}))
    with pytest.raises(destinations.WriteError) as e:
      _write(path, "ours: " + "x" * 10000)
  message = str(e.value)
  assert e.value.exit_code == errors.EXIT_STORAGE and "\n" not in message
  assert message.startswith(f"cannot write the report {path}") and "INTACT" in message
  assert ("read-only" if fault == "readonly" else "no space left") in message, message
  assert faults.snapshot(tmp_path) == before
