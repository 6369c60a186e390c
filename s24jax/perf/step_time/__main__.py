"""`python -m s24jax.perf.step_time` (cli.py)."""
import sys

from s24jax.perf.step_time import cli

sys.exit(cli.main())
