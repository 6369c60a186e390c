"""`python -m s24jax.perf.step_time` (cli.py)."""
from s24jax.cli import command

command.guard_startup("s24jax.perf.step_time")   # before the imports (jax): Ctrl-C is one line

# pylint: disable=wrong-import-position
import sys

from s24jax.perf.step_time import cli

sys.exit(cli.main())
