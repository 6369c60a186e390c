"""Repository-wide pytest setup: the jax platform, and the `gpu` and `aot` markers.

Platform: with the optional CUDA compile plugin installed (requirements-gpu-aot.txt) and no
GPU, jax would try to start CUDA in every test process and print the failed version check
before falling back to the CPU; `aot.cpu_unless_gpu()` sets JAX_PLATFORMS=cpu first when no
NVIDIA driver is present and the user chose no platform. It changes nothing on a GPU host.

Tests marked `@pytest.mark.gpu` need a GPU backend (the kernels' native twins); they are
skipped when jax's default backend is not a GPU. Tests marked `@pytest.mark.aot` compile for a
GPU without one (kernels.compile_check); they are skipped without the CUDA compile plugin.
"""
import os
import tempfile

# One persistent JAX compilation cache for the session's workers and every process they
# start (launch.py subprocesses, the notebook's kernel): the tests compile the same tiny
# steps many times over (new closures, new processes), and a compiled program is looked up
# by its HLO, so what a test runs is unchanged; it saves about a quarter of the suite's CPU
# time. Kept between sessions in the temp folder; a variable set by the user wins.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"s24jax-tests-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The tests' programs are tiny: compiling them is most of the suite's time and running them
# almost none, so XLA's backend (LLVM) optimizations are off for the tests and the processes
# they start (about 40 % less time). The HLO is the one a run compiles; only the machine code
# is less optimized (float results may differ in the last bits, as between two CPUs; every
# comparison in the suite runs both sides under the same flags). Not set if XLA_FLAGS names it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

from s24jax.kernels import aot  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

aot.cpu_unless_gpu()   # before jax starts a backend (this module imports jax next)

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

for _name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):   # also if jax was imported first
  _now = getattr(jax.config, _name.lower())   # None: unset when jax was imported (a -p plugin)
  jax.config.update(_name.lower(), os.environ[_name] if _now is None else
                    type(_now)(os.environ[_name]))


def pytest_collection_modifyitems(config, items):
  """The `slow` tests (end-to-end runs, subprocesses: up to a minute or two each) first, in
  their file order, so that the two workers end on short tests instead of one of them
  finishing a long one alone."""
  del config
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "gpu: needs a GPU (skipped unless jax.default_backend() == 'gpu')")
  config.addinivalue_line(
      "markers", "aot: deviceless GPU compile (skipped without requirements-gpu-aot.txt)")


@pytest.fixture(autouse=True)
def _skip_gpu_tests_without_gpu(request):
  if (request.node.get_closest_marker("gpu") is not None
      and jax.default_backend() != "gpu"):
    pytest.skip("needs a GPU backend (jax.default_backend() != 'gpu')")
  if (request.node.get_closest_marker("aot") is not None
      and not aot.plugin_available()):
    pytest.skip(f"needs the CUDA compile plugin: {aot.INSTALL_HINT}")
