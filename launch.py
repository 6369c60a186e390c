"""Launches an s24jax experiment.

  python launch.py --config experiments/gpt2_s_ste.py:tiny --workdir runs/demo
  python launch.py --config experiments/gpt2_s_ste.py --config.total_steps=1000

`--config.path.to.field=value` overrides any field. Running the same command again resumes
from the last checkpoint in the workdir. Multi-host: add --distributed (calls
jax.distributed.initialize(), which reads the cluster from the environment).

The terminal shows the progress bar, s24jax's own messages and every warning; the INFO logs
of the libraries (Orbax, JAX, TFDS, ...) go to <workdir>/train.log with everything else.
"""
import logging as std_logging
import os

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file[:variant].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (checkpoints, logs, plots). "
                               "Default: runs/<config name>[_<variant>].")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize().")

_OURS = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "s24jax") + os.sep,
         os.path.abspath(__file__))


def default_workdir(config_arg: str) -> str:
  path, _, variant = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("runs", f"{name}_{variant}" if variant else name)


class _OnlyOursOrWarnings(std_logging.Filter):
  """Terminal filter: s24jax's (and this script's) records, and any library's warnings."""

  def filter(self, record) -> bool:
    return (record.levelno >= std_logging.WARNING
            or os.path.abspath(record.pathname).startswith(_OURS))


def _route_logs(workdir: str) -> str:
  """Library INFO to <workdir>/train.log only; the terminal keeps ours and the warnings."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "train.log")
  file_handler = std_logging.FileHandler(path, encoding="utf-8")
  file_handler.setFormatter(std_logging.Formatter(
      "%(asctime)s %(levelname).1s %(name)s %(filename)s:%(lineno)d] %(message)s"))
  root = std_logging.getLogger()
  root.addHandler(file_handler)
  root.setLevel(std_logging.INFO)
  logging.get_absl_handler().addFilter(_OnlyOursOrWarnings())
  return path


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  workdir = _WORKDIR.value or default_workdir(config_flags.get_config_filename(flags.FLAGS["config"]))
  log_path = _route_logs(workdir)
  import jax  # pylint: disable=g-import-not-at-top
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  from s24jax import loop  # pylint: disable=g-import-not-at-top
  logging.info("JAX %s on %d %s device(s); workdir %s (library logs: %s)", jax.__version__,
               jax.device_count(), jax.default_backend(), workdir, log_path)
  final = loop.train_and_evaluate(_CONFIG.value, workdir)
  logging.info("done at step %s: train loss %.4f, val loss %.4f (unigram entropy %.3f)",
               final.get("step"), final.get("train/loss", float("nan")),
               final.get("val/loss", float("nan")),
               final.get("data/unigram_entropy", float("nan")))


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
