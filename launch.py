"""Launches an s24jax experiment.

  python launch.py --config experiments/gpt2_s_ste.py:tiny --workdir runs/demo
  python launch.py --config experiments/gpt2_s_ste.py --config.total_steps=1000

`--config.path.to.field=value` overrides any field. Running the same command again resumes
from the last checkpoint in the workdir. Multi-host: add --distributed (calls
jax.distributed.initialize(), which reads the cluster from the environment).
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


def default_workdir(config_arg: str) -> str:
  path, _, variant = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("runs", f"{name}_{variant}" if variant else name)


class _QuietLibraries:
  """Drops INFO records of chatty libraries (Orbax logs every save phase) from absl logging."""

  def filter(self, record) -> bool:
    return record.levelno >= logging.WARNING or "orbax" not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  std_logging.getLogger("absl").addFilter(_QuietLibraries())
  import jax  # pylint: disable=g-import-not-at-top
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  from s24jax import loop  # pylint: disable=g-import-not-at-top
  workdir = _WORKDIR.value or default_workdir(config_flags.get_config_filename(flags.FLAGS["config"]))
  logging.info("JAX %s, devices: %s, workdir: %s", jax.__version__, jax.devices(), workdir)
  final = loop.train_and_evaluate(_CONFIG.value, workdir)
  print({k: round(v, 4) for k, v in final.items() if isinstance(v, float)})


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
