"""Fixtures shared by every test folder, and tests/ on sys.path for its helper modules
(`tiny`, the tiny configs) from the subfolders (methods/, sparse_ops/, kernels/, data/)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
  """One token cache for the whole session (the embedded corpus is tokenized once)."""
  path = str(tmp_path_factory.mktemp("s24jax_cache"))
  return path
