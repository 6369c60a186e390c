"""`python -m s24jax.gpu_report` (cli.py)."""
import sys

from s24jax.gpu_report import cli

sys.exit(cli.main())
