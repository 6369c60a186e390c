"""Which kernel runs each GEMM of a sparse layer (`sparsity.gemm_choice`): a 2:4 kernel only
where it was measured faster than the dense XLA GEMM of the same product.

A sparse layer's three GEMMs (sparse_ops/__init__.py) are 'forward' (y = x W~^T), 'dgrad'
(dX = dY W~) and 'wgrad' (dW~ = est(dY^T) x). Where a backend can run one on its 2:4 kernel,
this policy says whether it does; where it does not, the backend runs the dense XLA GEMM of
the same operands (the masked W~, the same MVUE estimate): only the kernel changes, never the
product. Values of `sparsity.gemm_choice` (VALUES):

  'measured'  (the default) the 2:4 kernel where its time, counting the compressions the step
              does for it, is below the dense GEMM's, from the times found for this GEMM
              (below); the dense GEMM where it is not, and where no time is found
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
chosen 2:4 GEMM uses is never made.

Where the times of a GEMM come from under 'measured' (the first that has them):
  1. the table file `sparsity.gemm_table` (gemm_times.py gives its format);
  2. this machine's cache of measurements, `gemm_times.cache_file()`;
  3. a measurement on the device at its first use: the backend times its kernel (compressed
     operand reused), the compression, and the dense GEMM, each as CALLS calls inside one
     jitted loop (`gemm_times.per_call_ms`; seconds per GEMM shape), written to the cache;
  4. none, where nothing can run (off a GPU: the CPU with the cuSPARSELt stand-in; a
     deviceless compile for a GPU, e.g. the planner): the dense GEMM, said once per process
     in a warning, so a step built without measurements never runs a 2:4 kernel it has no
     evidence for.
Each GEMM's choice is logged once per process when the step is traced (train.log).

Backends: 'cusparselt' consults this policy (sparse_ops/cusparselt.py builds each GEMM's
`gemm_times.Key` and measures it); a backend joins by doing the same (`Backend.choices`). The
others ignore it ('xla' has no 2:4 kernel; 'pallas' has its own rule; 'tcgen05' and
'pallas_always' run theirs everywhere) and refuse a GEMM forced dense (sparse_ops.check).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

from absl import logging

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
    t = self.times
    timing = ("" if t is None else
              f"; per call: 2:4 {t.sparse_cost_ms(self.compress_share):.4g} ms (kernel "
              f"{t.sparse_ms:.4g} + {self.compress_share:.3g} x compression "
              f"{t.compress_ms:.4g}) against dense {t.dense_ms:.4g} ms, from {t.source}")
    return f"{self.gemm} {self.label}: {kernel} ({self.reason}{timing})"


def no_choice(kind: str, label: str, why: str) -> Choice:
  """A GEMM the backend cannot run on its 2:4 kernel (e.g. dX without a transposable mask)."""
  return Choice(kind, False, why, label)


# ---------------------------------------------------------------------------------------------
# The choice.

_LOCK = threading.Lock()
_SAID: set = set()
# (table, key) -> the times found or measured for it (None: none), once per process: every
# trace of a step (train, eval, a recompiled phase) decides alike, and a file is read once.
_FOUND: dict = {}


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


def choose(value: str, table: str, key: gemm_times.Key, *, compress_share: float,
           label: str = "", measure: Callable[[], gemm_times.Times] | None = None) -> Choice:
  """The kernel of the GEMM `key` under sparsity.gemm_choice `value` and the table file
  `table` (module docstring); `measure` times it on the device (None: nothing can run here).
  Called while a step is traced, with static shapes; logged once per process."""
  force = forced(value, key.gemm)
  if (table, key) not in _FOUND:
    _FOUND[(table, key)] = gemm_times.find_times(table, key)
  times = _FOUND[(table, key)]
  if force is not None:
    choice = Choice(key.gemm, force, f"sparsity.gemm_choice={value!r}", label, times,
                    compress_share)
  else:
    failed = None
    if times is None and measure is not None:
      try:
        times = measure()
      except Exception as e:  # pylint: disable=broad-except
        # A kernel that cannot even be timed must not stop the run: it runs dense, said once.
        failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        _once(("failed", key), logging.warning,
              "sparsity.gemm_choice='measured': timing the 2:4 kernel of %s failed (%s); the "
              "dense XLA GEMM runs for it.", key, failed)
      else:
        _FOUND[(table, key)] = times
        gemm_times.store(key, times)
    if times is not None:
      faster = times.sparse_cost_ms(compress_share) < times.dense_ms
      choice = Choice(key.gemm, faster, "measured " + ("faster" if faster else "slower"),
                      label, times, compress_share)
    elif failed is not None:
      choice = Choice(key.gemm, False, f"its measurement failed ({failed})", label, None,
                      compress_share)
    else:
      choice = Choice(key.gemm, False, "nothing measured for it here", label, None,
                      compress_share)
      _once("unmeasured", logging.warning,
            "sparsity.gemm_choice='measured': no time for a sparse GEMM on %s (%s %s), "
            "and none can be measured in this process (no GPU: the CPU, a compile-only GPU, "
            "a stand-in of the library): the dense XLA GEMM runs, here and for every such "
            "GEMM. Give measured times with "
            "sparsity.gemm_table, or force the kernel with sparsity.gemm_choice "
            "(s24jax/sparse_ops/gemm_choice.py).", key.device_kind, key.library,
            key.library_version)
  _once((key, choice.sparse, compress_share, choice.reason), logging.info,
        "sparse GEMM choice: %s", choice.describe())
  return choice
