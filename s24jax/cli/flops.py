"""The planned training FLOPs of a config, without training (s24jax/training/flops.py counts them):

    python -m s24jax.cli.flops experiments/gpt2_mst.py:124m [path.to.field=value ...]

An MST run's active counts follow from its schedule alone, so the plan equals what the loop
logs; overrides are read as every command line reads them (s24jax/config_files.py). Writes
nothing. Exit codes (s24jax/errors.py): 0; 2 a user error, one line; 75 Ctrl-C; 1 a bug.
"""
from s24jax.cli import command

if __name__ == "__main__":
  command.guard_startup("s24jax.cli.flops")

# pylint: disable=wrong-import-position  (after the guard: Ctrl-C during imports is one line)
import sys

from s24jax import errors
from s24jax.kernels import aot
from s24jax.training import flops
from s24jax.training import validate

USAGE = ("usage: python -m s24jax.cli.flops experiments/X.py[:variant] "
         "[path.to.field=value ...]  (values: s24jax/config_files.py)")


def main(argv) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] in (["-h"], ["--help"]):
    print(__doc__.strip() + "\n\n" + USAGE)
    return errors.EXIT_OK
  if not argv:
    raise errors.UserError(f"no config file given; {USAGE}")
  if argv[0].startswith("-"):   # e.g. launch.py's --config: here the file comes first, bare
    raise errors.UserError(f"unknown option {argv[0]!r}: the config file comes first, without "
                           f"a flag; {USAGE}")
  aot.cpu_unless_gpu()   # no CUDA start-up noise where the optional compile plugin sits idle
  config = validate.load_config(argv[0], args=argv[1:])
  spec = validate.check_config(config)
  for k, v in flops.summary(flops.planned(spec)).items():
    print(f"{k:26s} {v:.4g}")
  return errors.EXIT_OK


if __name__ == "__main__":
  command.exit_with(command.run(main, name="s24jax.cli.flops"))
