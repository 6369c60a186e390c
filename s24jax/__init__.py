"""s24jax: 2:4 sparse pre-training of transformers in JAX/Flax.

The package, one folder per layer (README, "Layout"; each imports only the layers below it,
tests/test_imports.py): here the foundation (errors, destinations, config_files, state,
step_info, chores, metrics); data/ and sparse_ops/; methods/; nn/ the model; training/ the run;
and above the library, cli/ the commands a user runs and perf/ the planning and
GPU-performance tools. kernels/ is installed as s24jax.kernels.

Importing s24jax imports nothing else and makes no platform choice: the commands choose
(`kernels.aot.cpu_unless_gpu`) before jax starts a backend, so that a command's own start-up
(and its Ctrl-C handling, cli/command.py) begins at once. Module paths that moved in 0.4
answer one line naming the new one (moved.py).
"""
from s24jax import moved as _moved

__version__ = "0.4.0"

_moved.install()
