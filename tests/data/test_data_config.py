"""Tests for `defaults.data_config()` (s24jax/data/defaults.py), the `config.data` block, and
`sources.default_data_config()`, the data pipeline's view of it: the defaults written out
here, and the typed placeholders that command-line flags set."""

from __future__ import annotations

from s24jax.data import defaults as data_defaults
from s24jax.training import config as config_lib
from s24jax.data import sources


def test_default_data_config_fields():
  c = data_defaults.data_config()
  assert c.name == 'shakespeare' and c.val_fraction == 0.1 and c.text_key == 'text'
  assert c.tokenizer == 'gpt2'
  assert c.path is None and c.cache_dir is None and c.tfds_data_dir is None and c.max_docs is None
  c.path = '/some/folder'  # Placeholders accept their type (as command-line flags set them).
  c.max_docs = 10
  # The data pipeline's defaults are this block (a fresh copy: the edits above stay here).
  assert sources.default_data_config().to_dict() == data_defaults.data_config().to_dict()
  assert sources.default_data_config().path is None
  assert config_lib.base_config().data.to_dict() == data_defaults.data_config().to_dict()
  assert sources.EMBEDDED_DATASETS == ('shakespeare', 'text_folder')
