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
  0   trained to total_steps (or to --config.stop_at_step)
  1   an internal error (a bug, or a failure s24jax does not check for): its traceback, on
      the terminal and in <workdir>/train.log
  2   a user error: a bad command line, config value, data set or workdir, a checkpoint of
      another config, a backend that cannot run here (e.g. cusparselt off an A100/H100). One
      line names the field or file; checked before anything is written, so the workdir is
      as it was
  3   another run holds the workdir (its lock names it); nothing was written
  4   a non-finite loss or gradient norm stopped the run; nothing non-finite was saved, the
      message names the step and the last good checkpoint
  5   a checkpoint could not be saved (a full disk: the message names the step, its path and
      the previous checkpoint, which is intact) or none in the workdir can be read; or another
      write of the run failed after the checks (a full disk, a folder made read-only): one
      line, the complete checkpoints intact
  75  stopped by SIGTERM or SIGINT after saving the checkpoint of the step it was on (or,
      outside the training loop, with nothing lost): re-run the same command (requeue the
      job) to resume

Before anything is written, every place the run writes is checked (s24jax/destinations.py):
the workdir (the lock, written whole, is the first write; each entry of the run's of its
kind), its free space, the token cache's folder when the cache must be built.

The terminal shows the progress bar, s24jax's own messages and every warning; the INFO logs
of the libraries (Orbax, JAX, TFDS, ...), and their tracebacks, go to <workdir>/train.log with
everything else. train.log is opened once the run's checks pass: a run stopped by a user
error leaves no log behind.
"""
import logging as std_logging
import os
import signal
import sys


def _stop_while_importing(signum, frame) -> None:
  """Ctrl-C during the imports (seconds, much of it in C extensions, where a KeyboardInterrupt
  turns into an ImportError, or worse): one line and out; nothing was written yet."""
  del signum, frame
  os.write(2, b"launch.py: stopped by SIGINT while starting; nothing was written. Run the "
           b"same command again to start.\n")
  # errors.EXIT_PREEMPTED (s24jax is not imported yet)
  os._exit(75)   # pylint: disable=protected-access


if __name__ == "__main__":
  _default_sigint = signal.signal(signal.SIGINT, _stop_while_importing)

# pylint: disable=wrong-import-position
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

if __name__ == "__main__":
  signal.signal(signal.SIGINT, _default_sigint)   # KeyboardInterrupt again: main() says it

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
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")

_OURS = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "s24jax") + os.sep,
         os.path.abspath(__file__))
_OVERRIDE_PREFIXES = ("--config.", "-config.")
_overrides: list[str] = []   # 'path.to.field=value' items of --config.path.to.field=value
# Unchanged for scripts that import it; errors.EXIT_LOCKED.
EXIT_LOCKED = errors.EXIT_LOCKED


def _usage_error(message: str) -> None:
  """A bad command line: one line, exit code 2 (errors.EXIT_USER)."""
  sys.stderr.write(f"FATAL Flags parsing error: {message}\n"
                   "Pass --helpshort or --helpfull to see help on flags.\n")
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
  """Exceptions a library ignored (sys.unraisablehook: e.g. tensorstore's callbacks into
  Orbax's closed event loop after a failed save, one traceback each) go to train.log, with
  one line on the terminal the first time, not a traceback each on the terminal."""
  said = []

  def hook(unraisable) -> None:
    record = std_logging.LogRecord(
        "unraisable", std_logging.WARNING, "<unraisable>", 0, "exception ignored in %r",
        (unraisable.object,), (unraisable.exc_type, unraisable.exc_value,
                               unraisable.exc_traceback))
    std_logging.getLogger().handle(record)   # the terminal filter keeps it off the terminal
    if not said:
      said.append(True)
      logging.warning("a library ignored an exception (%s: %s); it and any later ones are in "
                      "train.log", unraisable.exc_type.__name__, unraisable.exc_value)

  sys.unraisablehook = hook


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
  try:
    _main(argv)
  except KeyboardInterrupt:   # outside the training loop, whose signals preemption.py handles
    logging.warning("stopped by SIGINT outside the training loop; the checkpoints already "
                    "written are intact. Run the same command again (exit code %d)",
                    errors.EXIT_PREEMPTED)
    sys.exit(errors.EXIT_PREEMPTED)


def _main(argv):
  if len(argv) > 1:
    _usage_error(f"unexpected arguments: {argv[1:]} (a field is set with "
                 "--config.path.to.field=value)")
  held = _terminal_logs()
  _ignored_exceptions_to_the_log()
  try:
    config = validate.load_config(_CONFIG.value, args=_overrides)
  except errors.UserError as e:
    logging.error("%s", e)
    sys.exit(e.exit_code)
  workdir = _WORKDIR.value or default_workdir(_CONFIG.value)
  explicit = {name: f.value for name, f in (("coordinator_address", _COORDINATOR),
                                            ("num_processes", _NUM_PROCESSES),
                                            ("process_id", _PROCESS_ID)) if f.value is not None}
  distributed = _DISTRIBUTED.value or bool(explicit)
  process = _PROCESS_ID.value or 0
  # The lock comes first: a second run on this workdir must write nothing, not even a log.
  lock = workdir_lib.WorkdirLock(workdir)
  if process == 0:
    try:
      lock.acquire()
    except errors.KnownError as e:   # busy (3), or a workdir that cannot be created (2)
      logging.error("%s", e)
      sys.exit(e.exit_code)
  try:
    if explicit and not _DISTRIBUTED.value:
      logging.info("%s given: running with --distributed", ", ".join(f"--{k}" for k in explicit))
    sys.exit(_train(config, workdir, distributed, process, held,
                    allow_unmatched=_ALLOW_UNMATCHED.value, source=_CONFIG.value))
  finally:
    if process == 0:
      lock.release()


def _train(config, workdir: str, distributed: bool, process: int, held: _Held, *,
           allow_unmatched: bool = False, source: str = "") -> int:
  """The run; its exit code (module docstring)."""
  log_path = []

  def start():   # the checks passed: from here on the run writes to its workdir
    log_path.append(_route_logs(workdir, process, held))
    logging.info("JAX %s on %d %s device(s) in %d process(es); workdir %s (library logs: %s)",
                 jax.__version__, jax.device_count(), jax.default_backend(),
                 jax.process_count(), workdir, log_path[0])

  try:
    aot.cpu_unless_gpu()   # no CUDA start-up noise where the optional compile plugin sits idle
    if distributed:
      if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                                 num_processes=_NUM_PROCESSES.value,
                                 process_id=_PROCESS_ID.value)
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
