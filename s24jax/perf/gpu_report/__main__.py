"""`python -m s24jax.perf.gpu_report` (cli.py)."""
import sys

from s24jax.perf.gpu_report import cli

sys.exit(cli.main())
