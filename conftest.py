"""Repository-wide pytest setup: the `gpu` marker.

Tests marked `@pytest.mark.gpu` need a GPU backend (the kernels' native
Triton twins); they are skipped when jax's default backend is not a GPU.
"""
import jax
import pytest


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "gpu: needs a GPU (skipped unless jax.default_backend() == 'gpu')")


@pytest.fixture(autouse=True)
def _skip_gpu_tests_without_gpu(request):
  if (request.node.get_closest_marker("gpu") is not None
      and jax.default_backend() != "gpu"):
    pytest.skip("needs a GPU backend (jax.default_backend() != 'gpu')")
