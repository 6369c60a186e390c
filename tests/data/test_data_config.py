"""Tests for `config.data_config()` (s24jax/config.py), the `config.data` block, and
`sources.default_data_config()`, the data pipeline's view of it: the defaults written out
here, and the typed placeholders that command-line flags set."""

from __future__ import annotations

from s24jax import config as config_lib
from s24jax.data import sources


def test_default_data_config_fields():
  c = config_lib.data_config()
  assert c.name == 'shakespeare' and c.val_fraction == 0.1 and c.text_key == 'text'
  assert c.tokenizer == 'gpt2'
  assert c.path is None and c.cache_dir is None and c.tfds_data_dir is None and c.max_docs is None
  c.path = '/some/folder'  # Placeholders accept their type (as command-line flags set them).
  c.max_docs = 10
  # The data pipeline's defaults are this block (a fresh copy: the edits above stay here).
  assert sources.default_data_config().to_dict() == config_lib.data_config().to_dict()
  assert sources.default_data_config().path is None
  assert config_lib.base_config().data.to_dict() == config_lib.data_config().to_dict()
  assert sources.EMBEDDED_DATASETS == ('shakespeare', 'text_folder')
