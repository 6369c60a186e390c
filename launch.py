"""Launches an s24jax experiment.

  python launch.py --config experiments/gpt2_s_ste.py:tiny --workdir runs/demo
  python launch.py --config experiments/gpt2_s_ste.py --config.total_steps=1000

`--config.path.to.field=value` overrides any field (values are read as every s24jax command
line reads them: s24jax/config_files.py). Running the same command again resumes
from the last checkpoint in the workdir (step 0 included). The whole run is checked before
anything is written (s24jax/training/validate.py); a mistake is one line naming the field.

Multi-host: add --distributed (jax.distributed.initialize(), which reads the cluster from the
environment on SLURM, Open MPI, Kubernetes, TPU pods), or give the cluster explicitly; any of
--coordinator_address, --num_processes, --process_id implies --distributed:

  python launch.py --config ... --coordinator_address=10.0.0.1:1234 \
      --num_processes=2 --process_id=0      # and --process_id=1 on the second host

On CPU hosts the processes talk through gloo (JAX's CPU collectives).

Exit codes (README.md, "Exit codes"; docs/resuming.md):
  0   trained to total_steps (or to --config.stop_at_step); also after a SIGTERM / SIGINT
      during the last step, which the run finishes (it says so)
  1   an internal error (a bug, or a failure s24jax does not check for): its traceback, on
      the terminal and in <workdir>/train.log
  2   a user error: a bad command line (a flag out of range, a workdir that is a file or a
      dangling link, something else named run.lock), config value, data set or workdir, a
      checkpoint of another config, a backend that cannot run here (e.g. cusparselt off an
      A100/H100), a cluster --distributed cannot find or reach. One line names the field or
      file; checked before anything is written, so the workdir is as it was
  3   another run holds the workdir (its lock names it); nothing was written
  4   a non-finite loss or gradient norm stopped the run; nothing non-finite was saved, the
      message names the step and the last good checkpoint
  5   a checkpoint could not be saved (a full disk: the message names the step, its path and
      the previous checkpoint, which is intact) or none in the workdir can be read; or another
      write of the run failed after the checks (a full disk, a folder made read-only): one
      line, the complete checkpoints intact
  6   the train step does not fit the device's memory (compiled and checked before step 1,
      nothing written; the line names the nearest setting that fits: s24jax/training/fit.py)
  75  stopped by SIGTERM or SIGINT after saving the checkpoint of the step it was on (or,
      outside the training loop, from the first instant of the command, with nothing lost):
      one line; re-run the same command (requeue the job) to resume

Before anything is written, every place the run writes is checked (s24jax/destinations.py):
the workdir (the lock, written whole, is the first write; each entry of the run's of its
kind), its free space, the token cache's folder when the cache must be built.

The terminal shows the progress bar, s24jax's own messages and every warning; the INFO logs
of the libraries (Orbax, JAX, TFDS, ...), and their tracebacks, go to <workdir>/train.log with
everything else. train.log is opened once the run's checks pass: a run stopped by a user
error leaves no log behind.
"""
from s24jax.cli import command

if __name__ == "__main__":
  # From this instant a Ctrl-C or SIGTERM is one line and exit code 75, nothing written: the
  # imports below take seconds, much of it in C extensions, where a KeyboardInterrupt turns
  # into an ImportError, or worse. main() takes over (command.run), then the loop (preemption.py).
  command.guard_startup("launch.py")

# pylint: disable=wrong-import-position
import logging as std_logging
import os
import re
import sys
import traceback

import jax
from absl import app, flags, logging

from s24jax import destinations
from s24jax import errors
from s24jax.training import loop
from s24jax.training import validate
from s24jax.training import workdir as workdir_lib
from s24jax.kernels import aot
from s24jax.kernels.cusparselt import library as cusparselt_library
from s24jax.kernels.cusparselt import ops as cusparselt_ops
# pylint: enable=wrong-import-position

_CONFIG = flags.DEFINE_string("config", None, "Experiment config file[:variant]; "
                              "--config.path.to.field=value overrides a field (repeatable).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (checkpoints, logs, plots). "
                               "Default: runs/<config name>[_<variant>].")
_ALLOW_UNMATCHED = flags.DEFINE_bool(
    "allow_unmatched_sparse_layers", False, "Run even if a pattern of "
    "config.sparsity.sparse_layers matches no layer of the model (a warning, not an error).")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() "
                                  "(implied by the three flags below).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 (default: from the environment).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.",
                                      lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, from 0.",
                                   lower_bound=0)
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+):(\d{1,5})")   # IPv6 in brackets
flags.register_validator(
    "coordinator_address", lambda v: v is None or (
        bool(m := _HOST_PORT.fullmatch(v)) and 0 < int(m[2]) < 65536),
    message="--coordinator_address must be host:port, the port in 1-65535 (e.g. "
            "10.0.0.1:1234)")
flags.register_multi_flags_validator(
    ["num_processes", "process_id"], lambda f: None in f.values() or (
        f["process_id"] < f["num_processes"]),
    message="--process_id must be below --num_processes (the processes are numbered from 0)")

_OURS = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "s24jax") + os.sep,
         os.path.abspath(__file__))
_OVERRIDE_PREFIXES = ("--config.", "-config.")
_overrides: list[str] = []   # 'path.to.field=value' items of --config.path.to.field=value
# Unchanged for scripts that import it; errors.EXIT_LOCKED.
EXIT_LOCKED = errors.EXIT_LOCKED


def _usage_error(message: str) -> None:
  """A bad command line: one line, exit code 2 (errors.EXIT_USER)."""
  sys.stderr.write(f"launch.py: {message} (python launch.py --helpshort lists the flags) "
                   f"(exit code {errors.EXIT_USER})\n")
  sys.exit(errors.EXIT_USER)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with the --config.FIELD=VALUE overrides taken out first: they are
  parsed against the loaded config (s24jax/config_files.py), not by absl. An error exits
  with code 2."""
  rest = []
  for i, arg in enumerate(argv):
    if arg == "--":
      rest += argv[i:]
      break
    if i and arg.startswith(_OVERRIDE_PREFIXES):
      if "=" not in arg:
        _usage_error(f"{arg} needs a value: {arg}=VALUE")
      _overrides.append(arg.split(".", 1)[1])
    else:
      rest.append(arg)
  try:
    return flags.FLAGS(rest)
  except flags.Error as e:
    _usage_error(" ".join(str(e).split()))


def default_workdir(config_arg: str) -> str:
  path, _, variant = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("runs", f"{name}_{variant}" if variant else name)


class _OnlyOursOrWarnings(std_logging.Filter):
  """Terminal filter: s24jax's (and this script's) records, and any library's warnings
  without a traceback (a library's traceback goes to train.log only: the error that stops
  the run says what happened in one line, e.g. Orbax's failed save)."""

  def filter(self, record) -> bool:
    if os.path.abspath(record.pathname).startswith(_OURS):
      return True
    return record.levelno >= std_logging.WARNING and not record.exc_info


class _Held(std_logging.Handler):
  """Holds the records of the start-up until train.log is opened (or the run stops)."""

  def __init__(self):
    super().__init__(std_logging.INFO)
    self.records: list[std_logging.LogRecord] = []

  def emit(self, record) -> None:
    self.records.append(record)


class _LogFile(std_logging.FileHandler):
  """train.log. A write that fails (a full disk: the workdir's) is said once, in one line on
  the terminal, and the log goes on there alone, instead of a "--- Logging error ---"
  traceback for every record after it."""
  broken = False

  def emit(self, record) -> None:
    if not self.broken:
      super().emit(record)

  def handleError(self, record) -> None:
    del record
    if not self.broken:
      self.broken = True
      error = sys.exc_info()[1]
      sys.stderr.write(f"W launch.py] cannot write {self.baseFilename} ({error}): the rest of "
                       "the log goes to the terminal only\n")


def _terminal_logs() -> _Held:
  """The terminal keeps ours and the warnings; the rest is held for train.log."""
  root = std_logging.getLogger()
  root.setLevel(std_logging.INFO)
  logging.get_absl_handler().addFilter(_OnlyOursOrWarnings())
  held = _Held()
  root.addHandler(held)
  return held


def _ignored_exceptions_to_the_log() -> None:
  """Exceptions a library ignored (sys.unraisablehook, one traceback each) go to train.log,
  with one line on the terminal the first time, not a traceback each on the terminal; none
  for what a failed checkpoint read or save leaves (`_checkpoint_aftermath`): that failure
  has its own line."""
  said = []

  def hook(unraisable) -> None:
    record = std_logging.LogRecord(
        "unraisable", std_logging.WARNING, "<unraisable>", 0, "exception ignored in %r",
        (unraisable.object,), (unraisable.exc_type, unraisable.exc_value,
                               unraisable.exc_traceback))
    std_logging.getLogger().handle(record)   # the terminal filter keeps it off the terminal
    if _checkpoint_aftermath(unraisable.exc_value):
      return   # the failed read or save behind it is said in its own line (checkpoint.py)
    if not said:
      said.append(True)
      first = (str(unraisable.exc_value).strip().splitlines() or [""])[0][:200]
      logging.warning("a library ignored an exception (%s: %s); it and any later ones are in "
                      "train.log", unraisable.exc_type.__name__, first)

  sys.unraisablehook = hook


def _checkpoint_aftermath(error: BaseException | None) -> bool:
  """Whether `error`, an exception a library ignored, is what a checkpoint that failed to read
  or save leaves behind: Orbax's read coroutines closed half-way (their error holds a
  TensorStore spec of 50 lines), tensorstore's callbacks into Orbax's closed event loop."""
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    return True
  frames = traceback.extract_tb(error.__traceback__) if error is not None else []
  return any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in frames)


def _route_logs(workdir: str, process: int = 0, held: _Held | None = None) -> str:
  """Library INFO to <workdir>/train.log only (with what was held since the start)."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "train.log" if not process else f"train.process{process}.log")
  file_handler = _LogFile(path, encoding="utf-8")
  file_handler.setFormatter(std_logging.Formatter(
      "%(asctime)s %(levelname).1s %(name)s %(filename)s:%(lineno)d] %(message)s"))
  root = std_logging.getLogger()
  root.setLevel(std_logging.INFO)
  if held is not None:
    root.removeHandler(held)
    for record in held.records:
      file_handler.handle(record)
    held.records.clear()
  root.addHandler(file_handler)
  return path


def main(argv):
  """_main on the shared error path (s24jax/cli/command.py): from here a Ctrl-C or SIGTERM
  outside the training loop (whose own handling, preemption.py, saves the step first) is one
  line and exit code 75; the run's own errors are said by _main and _train."""
  command.exit_with(command.run(_main, argv, name="launch.py", stopped="the checkpoints already "
                       "written are intact: run the same command again to resume"))


def _main(argv):
  if len(argv) > 1:
    _usage_error(f"unexpected arguments: {argv[1:]} (a field is set with "
                 "--config.path.to.field=value)")
  held = _terminal_logs()
  _ignored_exceptions_to_the_log()
  try:
    config = validate.load_config(_CONFIG.value, args=_overrides)
  except errors.UserError as e:
    logging.error("%s (exit code %d)", e, e.exit_code)
    sys.exit(e.exit_code)
  workdir = _WORKDIR.value or default_workdir(_CONFIG.value)
  explicit = {name: f.value for name, f in (("coordinator_address", _COORDINATOR),
                                            ("num_processes", _NUM_PROCESSES),
                                            ("process_id", _PROCESS_ID)) if f.value is not None}
  distributed = _DISTRIBUTED.value or bool(explicit)
  # The lock comes first: a second run on this workdir must write nothing, not even a log.
  # Process 0 takes it here; a process whose index only jax.distributed.initialize learns
  # (from the cluster's environment) leaves it to the loop, which takes it as process 0
  # (tested with one process and explicit flags; never run on a real cluster).
  first = not distributed or _PROCESS_ID.value == 0
  lock = workdir_lib.WorkdirLock(workdir)
  if first:
    try:
      lock.acquire()
    except errors.KnownError as e:   # busy (3), or a workdir that cannot be created (2)
      logging.error("%s (exit code %d)", e, e.exit_code)
      sys.exit(e.exit_code)
  try:
    if explicit and not _DISTRIBUTED.value:
      logging.info("%s given: running with --distributed", ", ".join(f"--{k}" for k in explicit))
    sys.exit(_train(config, workdir, distributed, held, allow_unmatched=_ALLOW_UNMATCHED.value,
                    source=_CONFIG.value))
  finally:
    if first:
      lock.release()


def _start_distributed() -> None:
  """jax.distributed.initialize with the cluster flags (None: from the environment); a
  cluster it cannot find or reach is a UserError, one line (nothing was written)."""
  if jax.config.jax_platforms == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
  except (ValueError, RuntimeError) as e:   # no cluster in the environment, no coordinator
    why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    raise errors.UserError(
        f"cannot start the distributed run ({why}): give --coordinator_address, "
        "--num_processes and --process_id, or run it under a cluster manager JAX detects "
        "(SLURM, Open MPI, Kubernetes, a TPU pod)") from e


def _train(config, workdir: str, distributed: bool, held: _Held, *,
           allow_unmatched: bool = False, source: str = "") -> int:
  """The run; its exit code (module docstring)."""
  log_path = []

  def start():   # the checks passed: from here on the run writes to its workdir
    log_path.append(_route_logs(workdir, jax.process_index(), held))
    logging.info("JAX %s on %d %s device(s) in %d process(es); workdir %s (library logs: %s)",
                 jax.__version__, jax.device_count(), jax.default_backend(),
                 jax.process_count(), workdir, log_path[0])

  try:
    aot.cpu_unless_gpu()   # no CUDA start-up noise where the optional compile plugin sits idle
    if distributed:
      _start_distributed()
    final = loop.train_and_evaluate(config, workdir, on_start=start,
                                    allow_unmatched_layers=allow_unmatched, source=source)
  except errors.KnownError as e:
    log = logging.warning if e.exit_code == errors.EXIT_PREEMPTED else logging.error
    log("%s (exit code %d)", e, e.exit_code)
    return e.exit_code
  except (cusparselt_ops.UnsupportedDevice, cusparselt_library.Unavailable) as e:
    logging.error("%s (exit code %d)", " ".join(str(e).split()), errors.EXIT_USER)
    return errors.EXIT_USER
  except Exception as e:  # pylint: disable=broad-except
    if destinations.is_write_error(e, under=workdir):   # a full disk, a read-only folder
      error = destinations.write_failed(
          e, f"the run's files in {workdir}", "The checkpoints already complete are intact: "
          "fix the folder (or free space) and run the same command again to resume")
      logging.error("%s (exit code %d)", error, error.exit_code)
      return error.exit_code
    if not log_path and os.path.isdir(workdir):
      try:
        start()   # an internal error: its traceback belongs in train.log too
      except OSError:
        pass
    logging.exception("internal error (exit code %d): the traceback below is s24jax's or a "
                      "library's, not a mistake in the command line", errors.EXIT_CRASH)
    return errors.EXIT_CRASH
  finally:
    std_logging.getLogger().removeHandler(held)
  logging.info("%s", done_line(final, config))
  return errors.EXIT_OK


def done_line(final: dict, config) -> str:
  """The run's last line: the step it stopped at and the losses it logged."""
  stopped = "step" not in final   # stop_at_step: the finals of a finished run are not written
  step = int(final.get("step", config.get("stop_at_step", -1)))
  losses = ", ".join(f"{name} {final[key]:.4f}" for name, key in (
      ("train loss", "train/loss"), ("val loss", "val/loss")) if key in final)
  entropy = (f" (unigram entropy {final['data/unigram_entropy']:.3f})"
             if "data/unigram_entropy" in final else "")
  what = (f"stopped at step {step} (config.stop_at_step)" if stopped else f"done at step {step}")
  return f"{what}: {losses or 'nothing logged yet'}{entropy}"


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=parse_flags)
