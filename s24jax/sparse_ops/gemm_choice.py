"""Which kernel runs each GEMM of a sparse layer (`sparsity.gemm_choice`): a 2:4 kernel only
where it was measured faster than the dense XLA GEMM of the same product.

A sparse layer's three GEMMs (sparse_ops/__init__.py) are 'forward' (y = x W~^T), 'dgrad'
(dX = dY W~) and 'wgrad' (dW~ = est(dY^T) x). Where a backend can run one on its 2:4 kernel,
this policy says whether it does; where it does not, the backend runs the dense XLA GEMM of
the same operands (the masked W~, the same MVUE estimate): only the kernel changes, never the
product. Values of `sparsity.gemm_choice` (VALUES):

  'measured'  (the default) the 2:4 kernel where its time, counting the compressions the step
              does for it, is below the dense GEMM's by more than the measurements' spread,
              from the times found for this GEMM (below); the dense GEMM where it is not,
              and where no time is found
  'sparse'    the 2:4 kernel wherever the backend can (experiments, the compile checks)
  'dense'     the dense GEMM everywhere (the backend's memory layout and checks, no 2:4 kernel)
  'forward+dgrad' (any '+'-joined subset of KINDS) those GEMMs on the 2:4 kernel, the others
              dense

The cost of a 2:4 GEMM per call (`gemm_times.Times.sparse_cost_ms`) is the kernel on an operand
compressed beforehand, plus the share of that operand's compression the call carries: W~ for
the forward and W~^T for the data gradient are compressed once per optimizer step (the
backend's `prepare`), so a call carries 1 / (micro-batches per step) of it; an operand
compressed in the call itself (the MVUE estimate of each micro-batch's dY^T, or W~ where
nothing was prepared: the tied head, evaluation) carries all of it. A compression that no
chosen 2:4 GEMM uses is never made. The margin it must win by (`Times.margin_ms`) is the sum
of the spreads (max - min over the timed loops) of the kernel, of the compression times its
share, and of the dense GEMM: 0 for times without spreads (a table may leave them out).

Where the times of a GEMM come from under 'measured' (the first that has them):
  1. the table file `sparsity.gemm_table` (gemm_times.py gives its format);
  2. this machine's cache of measurements, `gemm_times.cache_file()`;
  3. a measurement on the device at its first use: the backend times its kernel (compressed
     operand reused), the compression, and the dense GEMM, each as CALLS calls inside one
     jitted loop (`gemm_times.per_call_stats`; seconds per GEMM shape), written to the cache
     (a cache that cannot be written is said once per process; the run goes on with the
     times measured);
  4. none, where nothing can run (off a GPU: the CPU with the cuSPARSELt stand-in; a
     deviceless compile for a GPU, e.g. the planner): the dense GEMM, said once per process
     in a warning, so a step built without measurements never runs a 2:4 kernel it has no
     evidence for.
Each GEMM's choice is logged once per process when the step is traced (train.log). What
was found, measured or failed is kept for the process: every trace of a step decides alike.

With several processes (jax.process_count() > 1) only process 0 looks up and measures; the
times it found (or none) are broadcast to the others (its table and cache alone count), so
that every process compiles the same kernels into the step, as the processes of one program
must. The broadcast has run with two CPU processes, never on GPUs.

Evaluation runs no backward: under `forward_only()` (train.eval_step) the 'dgrad' and 'wgrad'
GEMMs are dense without a look-up or a measurement ("not run: forward only").

Backends: 'cusparselt' consults this policy (sparse_ops/cusparselt.py builds each GEMM's
`gemm_times.Key` and measures it); a backend joins by doing the same (`Backend.choices`). The
others ignore it ('xla' has no 2:4 kernel; 'pallas' has its own rule; 'tcgen05' and
'pallas_always' run theirs everywhere) and refuse a GEMM forced dense (sparse_ops.check); a
table or another value they would ignore is said in one warning when the run is validated
(`warn_if_ignored`, from validate.check_config).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from typing import Callable, Iterator

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from s24jax.sparse_ops import gemm_times
from s24jax.sparse_ops.gemm_times import KINDS

MODES = ("measured", "sparse", "dense")
DEFAULT = "measured"


def valid_values() -> str:
  return (f"{', '.join(repr(m) for m in MODES)}, or a '+'-joined subset of "
          f"{', '.join(KINDS)} (e.g. 'forward+dgrad')")


def check(value: str) -> None:
  """Raises ValueError (one line) unless `value` is a valid sparsity.gemm_choice."""
  if isinstance(value, str) and (value in MODES or (
      value and all(part in KINDS for part in value.split("+"))
      and len(set(value.split("+"))) == len(value.split("+")))):
    return
  raise ValueError(f"unknown sparsity.gemm_choice {value!r}; valid: {valid_values()}")


def forced(value: str, kind: str) -> bool | None:
  """Whether `value` forces the GEMM `kind` sparse (True) or dense (False); None: measured."""
  if value == "measured":
    return None
  if value in ("sparse", "dense"):
    return value == "sparse"
  return kind in value.split("+")


@dataclasses.dataclass(frozen=True)
class Choice:
  """One GEMM's kernel: `sparse` (the 2:4 kernel) or not, and why."""
  gemm: str                  # KINDS
  sparse: bool
  reason: str
  label: str = ""            # the GEMM in the layer's terms, for the log and the planner
  times: gemm_times.Times | None = None
  compress_share: float = 1.0

  def sparse_saving_ms(self) -> float | None:
    """Milliseconds per call the 2:4 kernel saves against the dense GEMM, chosen or not
    (negative: it costs), from the times found; None without times."""
    if self.times is None:
      return None
    return self.times.dense_ms - self.times.sparse_cost_ms(self.compress_share)

  def saving_ms(self) -> float | None:
    """Milliseconds per call the chosen kernel saves against the dense GEMM (negative: it
    costs): 0 for the dense GEMM; None where a 2:4 kernel was chosen without times."""
    return self.sparse_saving_ms() if self.sparse else 0.0

  def describe(self) -> str:
    kernel = "2:4 kernel" if self.sparse else "dense XLA GEMM"
    t, share = self.times, self.compress_share
    timing = ("" if t is None else
              f"; per call: 2:4 {t.sparse_cost_ms(share):.4g} ms (kernel {t.sparse_ms:.4g} + "
              f"{share:.3g} x compression {t.compress_ms:.4g}) against dense "
              f"{t.dense_ms:.4g} ms, margin {t.margin_ms(share):.4g} ms (the spreads), from "
              f"{t.source}")
    return f"{self.gemm} {self.label}: {kernel} ({self.reason}{timing})"


def warn_if_ignored(sparsity, registry) -> None:
  """One warning where `sparsity` (a SparsityConfig) sets sparsity.gemm_table, or a
  sparsity.gemm_choice other than DEFAULT, that its backend would silently ignore: one that
  does not consult this policy ('xla' has no 2:4 kernel; the others pick their kernels
  themselves, and refuse a GEMM forced dense: sparse_ops.check). `registry`: the backends'
  (the sparse_ops package: get_backend, available_backends), which import this module."""
  settings = []
  if sparsity.gemm_table:
    settings.append(f"sparsity.gemm_table={sparsity.gemm_table!r}")
  if sparsity.gemm_choice != DEFAULT:
    settings.append(f"sparsity.gemm_choice={sparsity.gemm_choice!r}")
  backend = registry.get_backend(sparsity.backend)
  if not settings or backend.choices is not None:
    return
  users = [n for n in registry.available_backends()
           if registry.get_backend(n).choices is not None]
  logging.warning(
      "%s not used: sparsity.backend=%r does not consult the GEMM choice (%s); it is used by "
      "sparsity.backend=%s (s24jax/sparse_ops/gemm_choice.py).",
      " and ".join(settings) + (" are" if len(settings) > 1 else " is"), sparsity.backend,
      "it has no 2:4 kernel" if not backend.needs_24 else "it picks its kernels itself",
      " or ".join(repr(n) for n in users))


def no_choice(kind: str, label: str, why: str) -> Choice:
  """A GEMM the backend cannot run on its 2:4 kernel (e.g. dX without a transposable mask)."""
  return Choice(kind, False, why, label)


# ---------------------------------------------------------------------------------------------
# The choice.

_LOCK = threading.Lock()
_SAID: set = set()
# What this process found, measured or failed, once per process: every trace of a step
# (train, eval, a recompiled phase) decides alike, a file is read and a GEMM measured once,
# and with several processes each broadcast is made once, by all of them alike.
_FOUND: dict = {}
_FORWARD_ONLY = contextvars.ContextVar("s24jax_gemm_choice_forward_only", default=False)


def forget() -> None:
  """Forgets what this process found, measured and said (as a new process would)."""
  with _LOCK:
    _FOUND.clear()
    _SAID.clear()


def _once(what, log: Callable[..., None], msg: str, *args) -> None:
  with _LOCK:
    if what in _SAID:
      return
    _SAID.add(what)
  log(msg, *args)


@contextlib.contextmanager
def forward_only() -> Iterator[None]:
  """Inside: a step with no backward is traced (evaluation), so `choose` makes the 'dgrad'
  and 'wgrad' GEMMs dense ("not run: forward only") without looking up or measuring them."""
  token = _FORWARD_ONLY.set(True)
  try:
    yield
  finally:
    _FORWARD_ONLY.reset(token)


def _found(table: str, key: gemm_times.Key) -> gemm_times.Times | None:
  """The times of `key` in the table or the cache (once per process)."""
  if ("found", table, key) not in _FOUND:
    _FOUND[("found", table, key)] = gemm_times.find_times(table, key)
  return _FOUND[("found", table, key)]


def _error(e: Exception) -> str:
  """The exception in one line (its type and its message's first line)."""
  return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _measured(key: gemm_times.Key, measure: Callable[[], gemm_times.Times]):
  """(times, None) measured and cached, or (None, why the measurement failed)."""
  try:
    times = measure()
  except Exception as e:  # pylint: disable=broad-except
    # A kernel that cannot even be timed must not stop the run: it runs dense, said once.
    failed = _error(e)
    _once(("failed", key), logging.warning,
          "sparsity.gemm_choice='measured': timing the 2:4 kernel of %s failed (%s); the "
          "dense XLA GEMM runs for it.", key, failed)
    return None, failed
  try:
    gemm_times.store(key, times)
  except Exception as e:  # pylint: disable=broad-except
    # The cache only saves the next process a measurement: this one goes on without it.
    _once("store failed", logging.warning,
          "sparsity.gemm_choice='measured': the GEMM times measured cannot be written to the "
          "cache %s (%s); this run uses them uncached (said once per process).",
          gemm_times.cache_file(), _error(e))
  return times, None


# The numbers of a Times broadcast from process 0 (NaN: none / no algorithm).
_NUMBERS = gemm_times.TIME_FIELDS + gemm_times.SPREAD_FIELDS


def _process_0s(times: gemm_times.Times | None) -> gemm_times.Times | None:
  """Process 0's `times` (what it found or measured, or None) on every process, as float32
  numbers, process 0 included, so that all of them compare the same numbers."""
  n = len(_NUMBERS)
  sent = np.full(n + len(gemm_times.ALGORITHM_FIELDS), np.nan, np.float32)
  if times is not None:
    sent[:n] = [getattr(times, f) for f in _NUMBERS]
    if times.algorithm is not None:
      sent[n:] = times.algorithm
  # In a thread of its own: its jitted psum must run, not join the step being traced.
  got = np.asarray(gemm_times.outside_trace(
      lambda: multihost_utils.broadcast_one_to_all(sent)), np.float64)
  if np.isnan(got[0]):
    return None
  source = times.source if times is not None else "process 0 (broadcast)"
  algorithm = None if np.isnan(got[n]) else tuple(int(v) for v in got[n:])
  return gemm_times.Times(**dict(zip(_NUMBERS, map(float, got[:n]))), source=source,
                          algorithm=algorithm)


def _agreed(table: str, key: gemm_times.Key, measure: Callable[[], gemm_times.Times] | None):
  """(times, why they failed or None) of `key` for 'measured': found, else measured, by
  this process or, with several, by process 0 for all (module docstring); once per process."""
  if ("agreed", table, key) not in _FOUND:
    times, failed = None, None
    several = jax.process_count() > 1
    if not several or jax.process_index() == 0:
      times = _found(table, key)
      if times is None and measure is not None:
        times, failed = _measured(key, measure)
    if several:
      times = _process_0s(times)
    _FOUND[("agreed", table, key)] = (times, failed)
  return _FOUND[("agreed", table, key)]


def choose(value: str, table: str, key: gemm_times.Key, *, compress_share: float,
           label: str = "", measure: Callable[[], gemm_times.Times] | None = None) -> Choice:
  """The kernel of the GEMM `key` under sparsity.gemm_choice `value` and the table file
  `table` (module docstring); `measure` times it on the device (None: nothing can run here).
  Called while a step is traced, with static shapes; logged once per process."""
  if _FORWARD_ONLY.get() and key.gemm != "forward":
    return Choice(key.gemm, False, "not run: forward only", label, None, compress_share)
  force = forced(value, key.gemm)
  if force is not None:
    choice = Choice(key.gemm, force, f"sparsity.gemm_choice={value!r}", label,
                    _found(table, key), compress_share)
  else:
    times, failed = _agreed(table, key, measure)
    if times is not None:
      cost, margin = times.sparse_cost_ms(compress_share), times.margin_ms(compress_share)
      sparse = cost + margin < times.dense_ms
      reason = ("measured faster" if sparse else "measured slower" if cost >= times.dense_ms
                else "measured faster by less than the margin")
      choice = Choice(key.gemm, sparse, reason, label, times, compress_share)
    elif failed is not None:
      choice = Choice(key.gemm, False, f"its measurement failed ({failed})", label, None,
                      compress_share)
    else:
      choice = Choice(key.gemm, False, "nothing measured for it here", label, None,
                      compress_share)
      _once("unmeasured", logging.warning,
            "sparsity.gemm_choice='measured': no time for a sparse GEMM on %s (%s %s), "
            "and none can be measured in this process (no GPU: the CPU, a compile-only GPU, "
            "a stand-in of the library; with several processes: none on process 0): the "
            "dense XLA GEMM runs, here and for every such GEMM. Give measured times with "
            "sparsity.gemm_table, or force the kernel with sparsity.gemm_choice "
            "(s24jax/sparse_ops/gemm_choice.py).", key.device_kind, key.library,
            key.library_version)
  _once((key, choice.sparse, compress_share, choice.reason), logging.info,
        "sparse GEMM choice: %s", choice.describe())
  return choice
