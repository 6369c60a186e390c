"""Helpers shared by the data tests (tests/data/): a data config as a plain attribute object,
the expected token stream of some documents (the reference the caches are checked against),
and a folder of .txt files. The fixtures (`no_network`, `shakespeare`) are in conftest.py."""

from __future__ import annotations

import pathlib
import types

import numpy as np

from s24jax.data import sources
from s24jax.data import tokenizer


def cfg(**overrides) -> types.SimpleNamespace:
  """A data config as a plain attribute object (load_tokens must not need a ConfigDict)."""
  base = dict(sources.default_data_config())
  base.update(overrides)
  return types.SimpleNamespace(**base)


def reference_stream(texts: list[str]) -> np.ndarray:
  """Expected cache content: each document's BPE tokens followed by <|endoftext|>."""
  enc = tokenizer.get_tokenizer()
  ids: list[int] = []
  for text in texts:
    ids += enc.encode_ordinary(text) + [tokenizer.EOT_ID]
  return np.asarray(ids, dtype=np.uint16)


FOLDER_DOCS = {
    'alpha.txt': 'Alpha document. It has some words.\nAnd a second line.\n',
    'beta.txt': 'Beta: numbers 1 2 3 and <|endoftext|> written literally.',
    'gamma.txt': 'Gamma gamma gamma, the third document.\n\n\n',
    'sub/delta.txt': 'Delta lives in a sub-folder; still one document.',
    'sub/epsilon.txt': 'Epsilon, naïve café, the fifth and last.',
}


def make_folder(root: pathlib.Path) -> pathlib.Path:
  """root/corpus holding FOLDER_DOCS (one in a sub-folder) and a .md file that is not read."""
  folder = root / 'corpus'
  for name, text in FOLDER_DOCS.items():
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text, encoding='utf-8')
  (folder / 'ignored.md').write_text('not a .txt file')
  return folder
