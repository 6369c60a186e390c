"""Tests for s24jax/metrics.py's metrics log: a torn last line (what a crash during a write
leaves) is dropped with a warning, never the records before it, and a resumed run keeps its
text aside; a bad line anywhere else is an error naming it. On a full disk (tests/faults.py,
as the kernel has it: a short write, then ENOSPC): a record cut short is cut back, a resumed
or restarted run's rewrite of the log leaves every file as it was, and the plot stays the
earlier one. References: records written out here by hand, and the rule "the last record of
a (step, keys) wins" applied by hand."""
import json
import logging
import os

import pytest

from s24jax import metrics as metrics_lib
from s24jax.training import workdir as workdir_lib

from faults import Faults, snapshot

RECORDS = [{"step": 0, "data/unigram_entropy": 6.4}, {"step": 5, "train/loss": 9.0},
           {"step": 10, "train/loss": 8.0}, {"step": 10, "val/loss": 8.5},
           {"step": 15, "train/loss": 7.0}]
TORN = '{"step": 20, "train/lo'   # a record cut by a crash: no closing brace, no newline


def _write(path, records, tail=""):
  path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_a_torn_last_line_is_dropped_and_a_bad_middle_line_named(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  # A step logged twice with the same keys (a resumed run): the later record wins.
  _write(path, RECORDS + [{"step": 5, "train/loss": 9.5}], TORN)
  with caplog.at_level(logging.WARNING):
    records = metrics_lib.read_jsonl(str(path))
  expected = [RECORDS[0], {"step": 5, "train/loss": 9.5}] + RECORDS[2:]
  assert records == expected
  assert "last line is not a whole record" in caplog.text
  assert metrics_lib.split_jsonl(str(path)) == (RECORDS + [{"step": 5, "train/loss": 9.5}], TORN)
  # Not JSON, or JSON that is no record, before the last line: the file was edited or damaged.
  for bad in (TORN, "[1, 2]", '{"train/loss": 1.0}'):
    _write(path, RECORDS[:2], bad + "\n" + json.dumps(RECORDS[2]) + "\n")
    with pytest.raises(metrics_lib.MetricsFileError, match=r"metrics.jsonl, line 3: not a "):
      metrics_lib.read_jsonl(str(path))


def test_a_resumed_writer_keeps_the_torn_text_aside(tmp_path):
  path = tmp_path / "metrics.jsonl"
  _write(path, RECORDS, TORN)
  writer = metrics_lib.MetricWriter(str(tmp_path), tensorboard=False, resume_step=10)
  writer.close()
  assert [json.loads(l) for l in path.read_text().splitlines()] == RECORDS[:4]
  superseded = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
  assert [json.loads(l) for l in superseded] == RECORDS[4:]
  assert (tmp_path / "metrics.jsonl.torn").read_text() == TORN + "\n"


def test_a_full_disk_while_a_resumed_run_rewrites_the_log_leaves_it(tmp_path, monkeypatch):
  path = tmp_path / "metrics.jsonl"
  _write(path, RECORDS)
  before = path.read_bytes()
  faults = Faults(monkeypatch)
  faults.full(tmp_path, ops=("fsync",))   # the rewrite's data never reaches the disk
  with pytest.raises(OSError, match="No space left"):
    metrics_lib.MetricWriter(str(tmp_path), tensorboard=False, resume_step=10)
  op, where = faults.hits[0]   # the rewrite's temporary file, synced before its rename
  assert op == "fsync" and os.path.basename(where).startswith(".metrics.jsonl.tmp-"), where
  assert path.read_bytes() == before   # and the records set aside are taken back: all or
  assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]   # nothing, so a rerun moves them once


def test_superseding_a_log_with_a_torn_line(tmp_path):
  """A run that starts again at step 0 moves the earlier attempt's records aside; a torn last
  line goes to metrics.jsonl.torn, not into the superseded records (where it would become a
  bad line in the middle)."""
  _write(tmp_path / "metrics.jsonl", RECORDS[:2], TORN)
  before = snapshot(tmp_path)
  workdir_lib.supersede_metrics(str(tmp_path))
  assert metrics_lib.read_jsonl(str(tmp_path / "metrics.superseded.jsonl")) == RECORDS[:2]
  assert (tmp_path / "metrics.jsonl.torn").read_text() == TORN + "\n"
  assert not (tmp_path / "metrics.jsonl").exists() and len(before) == 2


def test_a_record_a_full_disk_cuts_short_is_cut_back(tmp_path, monkeypatch):
  """A write that does not fit (tests/faults.py: 10 bytes free, a short write, then ENOSPC)
  leaves the log's whole records only, so the next record, once there is space, starts a
  line of its own instead of following half a one (a bad line in the middle)."""
  first = '{"step": 5, "train/loss": 9.0}\n'
  with monkeypatch.context() as m:
    faults = Faults(m)   # the writer opens its log under the fault: its writes meet it
    faults.full(tmp_path, free_bytes=len(first) + 10)
    writer = metrics_lib.MetricWriter(str(tmp_path), tensorboard=False)
    writer.write(5, {"train/loss": 9.0})
    with pytest.raises(OSError, match="No space left"):
      writer.write(10, {"train/loss": 8.0})
    assert faults.hits == [("write", str(tmp_path / "metrics.jsonl"))]   # after 10 bytes
  assert (tmp_path / "metrics.jsonl").read_text() == first
  writer.write(15, {"train/loss": 7.0})
  writer.close()
  assert metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl")) == [
      {"step": 5, "train/loss": 9.0}, {"step": 15, "train/loss": 7.0}]


@pytest.mark.parametrize("free_bytes", [0, 40])
def test_a_full_disk_while_superseding_leaves_every_file(free_bytes, tmp_path, monkeypatch):
  """Setting an earlier attempt's records aside (a restart at step 0, a resume) on a full
  disk: nothing fits, or the first append fits (40 bytes) and the next is cut short. Every
  file is as it was, so the next start sets the records aside once."""
  _write(tmp_path / "metrics.jsonl", RECORDS[:2], TORN)
  (tmp_path / "metrics.superseded.jsonl").write_text(json.dumps(RECORDS[4]) + "\n")
  before = snapshot(tmp_path)
  with monkeypatch.context() as m:
    Faults(m).full(tmp_path, free_bytes=free_bytes)
    with pytest.raises(OSError, match="No space left"):
      workdir_lib.supersede_metrics(str(tmp_path))
  assert snapshot(tmp_path) == before
  workdir_lib.supersede_metrics(str(tmp_path))   # space freed
  assert metrics_lib.read_jsonl(str(tmp_path / "metrics.superseded.jsonl")) == [
      RECORDS[0], RECORDS[1], RECORDS[4]]
  assert (tmp_path / "metrics.jsonl.torn").read_text() == TORN + "\n"


def test_a_full_disk_keeps_the_earlier_plot(tmp_path, monkeypatch):
  _write(tmp_path / "metrics.jsonl", RECORDS)
  png = metrics_lib.plot(str(tmp_path / "metrics.jsonl"), str(tmp_path / "metrics.png"))
  assert (tmp_path / "metrics.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
  before = snapshot(tmp_path)
  with monkeypatch.context() as m:
    Faults(m).full(tmp_path, free_bytes=100)   # the PNG's first 100 bytes fit
    with pytest.raises(OSError, match="No space left"):
      metrics_lib.plot(str(tmp_path / "metrics.jsonl"), png, title="again")
  assert snapshot(tmp_path) == before
