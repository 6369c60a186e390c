"""Tests for s24jax/metrics.py's metrics log: a torn last line (what a crash or a full disk
during a write leaves) is dropped with a warning, never the records before it, and a resumed
run keeps its text aside; a bad line anywhere else is an error naming it; a full disk while a
resumed run rewrites the log leaves the log as it was. References: records written out here
by hand, and the rule "the last record of a (step, keys) wins" applied by hand."""
import json
import logging
import os

import pytest

from s24jax import metrics as metrics_lib
from s24jax import workdir as workdir_lib

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
  assert path.read_bytes() == before
  assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "metrics.superseded.jsonl"]


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
