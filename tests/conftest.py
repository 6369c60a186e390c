import os

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
  """One token cache for the whole session (the embedded corpus is tokenized once)."""
  path = str(tmp_path_factory.mktemp("s24jax_cache"))
  return path
