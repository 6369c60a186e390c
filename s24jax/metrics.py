"""Metric writers (JSONL, TensorBoard), the loss/flip-rate plot, MFU.

The workdir gets `metrics.jsonl` (one record per write: the log of a step, an eval, a hook's
scalars; a step can have several records, `read_jsonl`/`series` read them all), TensorBoard
event files under `tensorboard/`, and `metrics.png`.

Each record is appended whole or not at all (a write a full disk cuts short is cut back), and
a resumed run rewrites the log all or nothing (`set_aside`). A last line that is not a whole
record (what a crash during a write leaves) is dropped with a warning, never the records
before it; a resumed run keeps its text in `metrics.jsonl.torn`. A bad line anywhere else is
a `MetricsFileError` naming the line (the file was edited or damaged): nothing is rewritten
then.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any, Iterable

import jax
import numpy as np
from absl import logging
from tensorboardX import SummaryWriter

from s24jax import destinations
from s24jax import errors

TORN_SUFFIX = ".torn"   # where a resumed run keeps a torn last line's text
SUPERSEDED_NAME = "metrics.superseded.jsonl"   # an earlier attempt's records past the resume

# Dense bf16 peak FLOP/s per device, for MFU when config.peak_flops is 0.
PEAK_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "v100": 125e12,
              "l4": 121e12, "a10": 125e12}


def device_peak_flops(device: jax.Device | None = None) -> float | None:
  kind = (device or jax.devices()[0]).device_kind.lower()
  for name, peak in PEAK_FLOPS.items():
    if name in kind:
      return peak
  return None


def mfu(tokens_per_sec: float, flops_per_token: float, peak_per_device: float | None,
        num_devices: int) -> float | None:
  """Model FLOPs utilisation in [0, 1]: achieved training FLOP/s over peak (dense count)."""
  if not peak_per_device:
    return None
  return tokens_per_sec * flops_per_token / (peak_per_device * num_devices)


class MetricWriter:
  """Writes scalars to JSONL and TensorBoard.

  A run resumed from the checkpoint of step `resume_step` continues one history: the records
  past that step from the earlier attempt (written after its last checkpoint) move to
  `metrics.superseded.jsonl`, TensorBoard purges its events past the step (`purge_step`), and
  a scalar the earlier attempt already wrote at the resume step itself is not written twice.
  So metrics.jsonl, the plot and final_metrics.json hold each step's values once.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True, enabled: bool = True,
               resume_step: int = 0):
    """enabled=False (every process but the first of a multi-host run) writes nothing."""
    self.workdir = workdir
    os.makedirs(workdir, exist_ok=True)
    self.jsonl_path = os.path.join(workdir, "metrics.jsonl")
    self.enabled = enabled
    self.history: dict[str, float] = {}   # the latest value of every scalar kept
    self._resume_step = resume_step
    self._written_at_resume: set[str] = set()
    if enabled and resume_step and os.path.exists(self.jsonl_path):
      self._truncate_after(resume_step)
    # Unbuffered: a record is written when `write` returns, or cut back (`_append`).
    self._jsonl = open(self.jsonl_path, "ab", buffering=0) if enabled else None
    self._tb = None
    if tensorboard and enabled:
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"),
                               purge_step=resume_step + 1 if resume_step else None)

  def _truncate_after(self, step: int) -> None:
    records, torn = split_jsonl(self.jsonl_path)
    records = _last_of_each(records)
    kept = [r for r in records if r["step"] <= step]
    for r in kept:
      self.history.update({k: v for k, v in r.items() if k != "step"})
      if r["step"] == step:
        self._written_at_resume.update(k for k in r if k != "step")
    superseded = [r for r in records if r["step"] > step]
    set_aside(self.jsonl_path, "".join(json.dumps(r) + "\n" for r in superseded), torn,
              "".join(json.dumps(r) + "\n" for r in kept))

  def write(self, step: int, scalars: dict[str, Any]) -> None:
    if not self.enabled:
      return
    record = {"step": int(step)}
    for k, v in scalars.items():
      if v is None or (step == self._resume_step and k in self._written_at_resume):
        continue
      v = float(v)
      record[k] = v
      if self._tb is not None and math.isfinite(v):
        self._tb.add_scalar(k, v, int(step))
    if len(record) == 1:
      return
    self._append(json.dumps(record) + "\n")

  def _append(self, line: str) -> None:
    """`line` appended whole or not at all: a failed write (a full disk, after a short write
    perhaps) cuts the log back to its last whole record, so no later record follows half a
    line (which a reader could only call a damaged file)."""
    data, end = memoryview(line.encode("utf-8")), self._jsonl.seek(0, os.SEEK_END)
    try:
      while data:
        data = data[self._jsonl.write(data):]
    except OSError:
      with contextlib.suppress(OSError):
        os.ftruncate(self._jsonl.fileno(), end)   # cutting back needs no space
      raise

  def write_text(self, tag: str, text: str) -> None:
    if self._tb is not None:
      self._tb.add_text(tag, text, 0)

  def flush(self) -> None:
    if self._jsonl is not None:
      self._jsonl.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    self.flush()
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


def set_aside(jsonl_path: str, superseded: str, torn: str | None, kept: str | None) -> None:
  """The log of a resumed or restarted run: `superseded` (whole lines, an earlier attempt's
  records past the resume step) appended to metrics.superseded.jsonl, a torn last line's
  text to metrics.jsonl.torn, and `kept` written as the log (None: the log removed). All or
  nothing (destinations.appending): a full disk midway leaves every file as it was, so the
  next start sets the same records aside once."""
  aside = os.path.join(os.path.dirname(jsonl_path), SUPERSEDED_NAME)
  with destinations.appending(aside, jsonl_path + TORN_SUFFIX):
    for path, text in ((aside, superseded), (jsonl_path + TORN_SUFFIX,
                                             None if torn is None else torn + "\n")):
      if text:
        with open(path, "a", encoding="utf-8") as f:
          f.write(text)
    if kept is None:
      os.remove(jsonl_path)
    else:
      destinations.write_atomic(jsonl_path, kept)
  if torn is not None:
    logging.warning("%s: its last line was not a whole record (what a crash or a full disk "
                    "during a write leaves): dropped, its text kept in %s%s", jsonl_path,
                    jsonl_path, TORN_SUFFIX)


class MetricsFileError(errors.UserError):
  """A metrics log with a bad line before its last (edited or damaged)."""


def split_jsonl(path: str) -> tuple[list[dict[str, Any]], str | None]:
  """(the records of a metrics log in file order, the text of a torn last line or None).
  MetricsFileError for a bad line before the last one, naming it."""
  with open(path, encoding="utf-8", errors="replace") as f:
    lines = [(i, line.strip()) for i, line in enumerate(f, 1) if line.strip()]
  records = []
  for n, (i, line) in enumerate(lines):
    try:
      record = json.loads(line)
      ok = isinstance(record, dict) and isinstance(record.get("step"), int)
    except ValueError:
      ok = False
    if ok:
      records.append(record)
    elif n == len(lines) - 1:
      return records, line
    else:
      raise MetricsFileError(
          f"{path}, line {i}: not a metrics record ({line[:60]!r}); only a last line can be "
          "torn by a crash, so the file was edited or damaged. Restore it from a copy, or "
          "move it away to start its log afresh (the checkpoints do not depend on it).")
  return records, None


def _last_of_each(records: list[dict]) -> list[dict]:
  """For a step logged twice with the same keys (a resumed run) the last record wins."""
  by_key = {(r["step"], tuple(sorted(r))): r for r in records}
  return sorted(by_key.values(), key=lambda r: r["step"])


def read_jsonl(path: str) -> list[dict[str, float]]:
  """Records of a metrics log; for a step logged twice (a resumed run) the last one wins; a
  torn last line is dropped with a warning (module docstring)."""
  records, torn = split_jsonl(path)
  if torn is not None:
    logging.warning("%s: its last line is not a whole record (what a crash or a full disk "
                    "during a write leaves): read without it", path)
  return _last_of_each(records)


def series(records: Iterable[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  pts = [(r["step"], r[key]) for r in records if key in r]
  if not pts:
    return np.zeros(0), np.zeros(0)
  s, v = zip(*pts)
  return np.asarray(s), np.asarray(v)


def plot(jsonl_path: str, png_path: str, *, title: str = "") -> str:
  """Train/val loss and (global and per-layer) flip rate against step, as a PNG."""
  # A bare Figure, not pyplot: no global backend switch (a notebook's inline plots keep working).
  # Imported here: matplotlib is slow to import and only this end-of-run plot needs it.
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  records = read_jsonl(jsonl_path)
  act_layers = sorted({k.split("/", 2)[2] for r in records for k in r
                       if k.startswith(("act/zero_frac/", "act/kept_l1/"))})
  fig = Figure(figsize=(18 if act_layers else 12, 4.5))
  axes = fig.subplots(1, 3 if act_layers else 2)
  ax_loss, ax_flip = axes[0], axes[1]
  if act_layers:
    _plot_activation_sparsity(axes[2], records, act_layers)
  for key, style in (("train/loss", "-"), ("val/loss", "o-")):
    s, v = series(records, key)
    if len(s):
      ax_loss.plot(s, v, style, label=key, markersize=3)
  s, v = series(records, "data/unigram_entropy")
  if len(v):
    ax_loss.axhline(v[-1], color="gray", ls="--", lw=1, label="unigram entropy")
  ax_loss.set_xlabel("step"), ax_loss.set_ylabel("loss (nats/token)"), ax_loss.legend()
  layer_keys = sorted({k for r in records for k in r if k.startswith("train/flip_rate/")})
  for k in layer_keys:
    s, v = series(records, k)
    ax_flip.plot(s, v, lw=0.7, alpha=0.5, label=k.split("train/flip_rate/")[1])
  s, v = series(records, "train/flip_rate")
  if len(s):
    ax_flip.plot(s, v, "k-", lw=2, label="all sparse layers")
    ax_flip.set_yscale("log")
  ax_flip.set_xlabel("step"), ax_flip.set_ylabel("flip rate")
  if layer_keys or len(s):
    ax_flip.legend(fontsize=6, ncol=2)
  else:
    ax_flip.text(0.5, 0.5, "no sparse layers", ha="center", transform=ax_flip.transAxes)
  fig.suptitle(title)
  fig.tight_layout()
  with destinations.atomic_file(png_path) as f:   # a full disk keeps the earlier plot
    fig.savefig(f, format="png", dpi=110)
  return png_path


def _plot_activation_sparsity(ax, records, layers) -> None:
  """Per layer: exact-zero fraction (solid) and V:N:M kept L1 share (dashed) of the FFN
  activations (s24jax/nn/act_sparsity.py)."""
  for i, layer in enumerate(layers):
    color = f"C{i % 10}"
    s, v = series(records, f"act/zero_frac/{layer}")
    ax.plot(s, v, "-", color=color, lw=1, label=f"{layer} zeros")
    s, v = series(records, f"act/kept_l1/{layer}")
    ax.plot(s, v, "--", color=color, lw=1, label=f"{layer} V:N:M kept L1")
  ax.set_ylim(0, 1.02)
  ax.set_xlabel("step"), ax.set_ylabel("fraction")
  ax.set_title("FFN activations", fontsize=9)
  ax.legend(fontsize=6, ncol=2)


def summarise(pending: list[dict], seconds: float, flops_per_token: float,
              peak: float | None, *, latest: str) -> dict[str, float]:
  """Host-side reduction of the fetched metrics of one log interval (the loop's log): the mean
  loss per token, the mean of every other metric over the steps that measured it (NaN = no
  measurement), except those starting with `latest` (method state: methods.base.STATE_METRICS),
  which keep their latest value."""
  out = {"train/loss": float(sum(m["loss"] for m in pending) / sum(m["count"] for m in pending))}
  for k in pending[-1]:
    if k in ("loss", "count", "finite"):
      continue
    if k.startswith(latest):
      out[f"train/{k}"] = float(pending[-1][k])
      continue
    values = np.asarray([m[k] for m in pending], np.float64)
    if not np.isnan(values).all():
      out[f"train/{k}"] = float(np.nanmean(values))
  tokens = sum(m["count"] for m in pending)
  out["perf/tokens_per_sec"] = float(tokens / seconds)
  out["perf/mfu"] = mfu(out["perf/tokens_per_sec"], flops_per_token, peak, jax.device_count())
  return out
