"""`python -m s24jax.perf.gpu_report` (cli.py)."""
from s24jax.cli import command

command.guard_startup("s24jax.perf.gpu_report")   # before the imports: Ctrl-C is one line

# pylint: disable=wrong-import-position
import sys

from s24jax.perf.gpu_report import cli

sys.exit(cli.main())
