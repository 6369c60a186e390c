"""`python -m s24jax.step_model` (cli.py)."""
import sys

from s24jax.step_model import cli

sys.exit(cli.main())
