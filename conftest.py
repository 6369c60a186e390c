"""Repository-wide pytest setup: the jax platform, and the `gpu` and `aot` markers.

Platform: with the optional CUDA compile plugin installed (requirements-gpu-aot.txt) and no
GPU, jax would try to start CUDA in every test process and print the failed version check
before falling back to the CPU; `aot.cpu_unless_gpu()` sets JAX_PLATFORMS=cpu first when no
NVIDIA driver is present and the user chose no platform. It changes nothing on a GPU host.

Tests marked `@pytest.mark.gpu` need a GPU backend (the kernels' native twins); they are
skipped when jax's default backend is not a GPU. Tests marked `@pytest.mark.aot` compile for a
GPU without one (kernels.compile_check); they are skipped without the CUDA compile plugin.
"""
from s24jax.kernels import aot

aot.cpu_unless_gpu()   # before jax starts a backend (this module imports jax next)

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


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
