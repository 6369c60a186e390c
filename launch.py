"""Launches an s24jax experiment.

  python launch.py --config experiments/gpt2_s_ste.py:tiny --workdir runs/demo
  python launch.py --config experiments/gpt2_s_ste.py --config.total_steps=1000

`--config.path.to.field=value` overrides any field (values are read as every s24jax command
line reads them: s24jax/config_files.py). Running the same command again resumes
from the last checkpoint in the workdir. A non-finite loss or gradient norm stops the run with
exit code 1 and a message naming the step and the last good checkpoint.

Multi-host: add --distributed (jax.distributed.initialize(), which reads the cluster from the
environment on SLURM, Open MPI, Kubernetes, TPU pods), or give the cluster explicitly; any of
--coordinator_address, --num_processes, --process_id implies --distributed:

  python launch.py --config ... --coordinator_address=10.0.0.1:1234 \
      --num_processes=2 --process_id=0      # and --process_id=1 on the second host

On CPU hosts the processes talk through gloo (JAX's CPU collectives).

Exit codes (docs/resuming.md):
  0   trained to total_steps (or to --config.stop_at_step)
  1   stopped by an error: a non-finite loss, a checkpoint that cannot be saved (a full
      disk) or read, a checkpoint that does not match the config, a backend that cannot run
      here (e.g. cusparselt off an A100/H100, or without its wheels); or a bad command line
  3   another run holds the workdir (its lock names it); nothing was written
  75  stopped by SIGTERM or SIGINT after saving the checkpoint of the step it was on:
      re-run the same command (requeue the job) to resume

The terminal shows the progress bar, s24jax's own messages and every warning; the INFO logs
of the libraries (Orbax, JAX, TFDS, ...) go to <workdir>/train.log with everything else.
"""
import logging as std_logging
import os
import sys

import jax
from absl import app, flags, logging

from s24jax import checkpoint
from s24jax import config_files
from s24jax import loop
from s24jax import preemption
from s24jax import workdir as workdir_lib
from s24jax.kernels import aot
from s24jax.kernels.cusparselt import library as cusparselt_library
from s24jax.kernels.cusparselt import ops as cusparselt_ops

_CONFIG = flags.DEFINE_string("config", None, "Experiment config file[:variant]; "
                              "--config.path.to.field=value overrides a field (repeatable).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (checkpoints, logs, plots). "
                               "Default: runs/<config name>[_<variant>].")
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


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with the --config.FIELD=VALUE overrides taken out first: they are
  parsed against the loaded config (s24jax/config_files.py), not by absl."""
  rest = []
  for i, arg in enumerate(argv):
    if arg == "--":
      rest += argv[i:]
      break
    if i and arg.startswith(_OVERRIDE_PREFIXES):
      if "=" not in arg:
        sys.exit(f"FATAL Flags parsing error: {arg} needs a value: {arg}=VALUE")
      _overrides.append(arg.split(".", 1)[1])
    else:
      rest.append(arg)
  return app.parse_flags_with_usage(rest)


def default_workdir(config_arg: str) -> str:
  path, _, variant = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("runs", f"{name}_{variant}" if variant else name)


class _OnlyOursOrWarnings(std_logging.Filter):
  """Terminal filter: s24jax's (and this script's) records, and any library's warnings."""

  def filter(self, record) -> bool:
    return (record.levelno >= std_logging.WARNING
            or os.path.abspath(record.pathname).startswith(_OURS))


def _route_logs(workdir: str, process: int = 0) -> str:
  """Library INFO to <workdir>/train.log only; the terminal keeps ours and the warnings."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "train.log" if not process else f"train.process{process}.log")
  file_handler = std_logging.FileHandler(path, encoding="utf-8")
  file_handler.setFormatter(std_logging.Formatter(
      "%(asctime)s %(levelname).1s %(name)s %(filename)s:%(lineno)d] %(message)s"))
  root = std_logging.getLogger()
  root.addHandler(file_handler)
  root.setLevel(std_logging.INFO)
  logging.get_absl_handler().addFilter(_OnlyOursOrWarnings())
  return path


EXIT_LOCKED = 3


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    config = config_files.load_config(_CONFIG.value, args=_overrides)
  except config_files.OverrideError as e:
    raise app.UsageError(str(e)) from None
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
    except workdir_lib.WorkdirLockedError as e:
      logging.error("%s", e)
      sys.exit(EXIT_LOCKED)
  try:
    log_path = _route_logs(workdir, process)
    if explicit and not _DISTRIBUTED.value:
      logging.info("%s given: running with --distributed", ", ".join(f"--{k}" for k in explicit))
    sys.exit(_train(config, workdir, log_path, distributed))
  finally:
    if process == 0:
      lock.release()


def _train(config, workdir: str, log_path: str, distributed: bool) -> int:
  aot.cpu_unless_gpu()   # no CUDA start-up noise where the optional compile plugin sits idle
  if distributed:
    if jax.config.jax_platforms == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
  logging.info("JAX %s on %d %s device(s) in %d process(es); workdir %s (library logs: %s)",
               jax.__version__, jax.device_count(), jax.default_backend(), jax.process_count(),
               workdir, log_path)
  try:
    final = loop.train_and_evaluate(config, workdir)
  except preemption.Preempted as e:
    logging.warning("%s (exit code %d)", e, preemption.EXIT_CODE)
    return preemption.EXIT_CODE
  except (loop.NonFiniteError, checkpoint.CheckpointSaveError,
          checkpoint.NoReadableCheckpointError, checkpoint.CheckpointMismatchError,
          cusparselt_ops.UnsupportedDevice, cusparselt_library.Unavailable) as e:
    logging.error("%s", e)
    return 1
  logging.info("done at step %s: train loss %.4f, val loss %.4f (unigram entropy %.3f)",
               final.get("step"), final.get("train/loss", float("nan")),
               final.get("val/loss", float("nan")),
               final.get("data/unigram_entropy", float("nan")))
  return 0


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=parse_flags)
