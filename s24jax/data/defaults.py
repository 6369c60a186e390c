"""`config.data`: the data pipeline's own defaults, which the run config (s24jax/training/
config.py) takes as its `data` block. Here, in data/, so that the pipeline reads its defaults
without importing the run config (and through it Flax, the model and every method).
"""
from __future__ import annotations

import ml_collections
from ml_collections import config_dict

# The embedded corpus (s24jax/data/text_corpus.py builds it) and its held-out share.
EMBEDDED_CORPUS = "shakespeare"
DEFAULT_VAL_FRACTION = 0.1


def data_config() -> ml_collections.ConfigDict:
  """`config.data`. Optional fields are typed placeholders so flags can set them."""
  return ml_collections.ConfigDict({
      # 'shakespeare', 'text_folder' (or set `path`), 'jsonl', 'parquet', 'token_files'
      # (llm.c / nanoGPT uint16 shards; all three at `path`, detected from it when the name is
      # left at its default), or any TFDS text dataset name. s24jax/data/sources.py.
      "name": EMBEDDED_CORPUS,
      "tokenizer": "gpt2",  # 'gpt2' (BPE, 50257 ids) or 'bytes' (UTF-8 bytes, 257 ids).
      # Folder of .txt files (one document per file), of .jsonl / .parquet files (one document
      # per record), or of .bin token files (or one such file).
      "path": config_dict.placeholder(str),
      "cache_dir": config_dict.placeholder(str),  # Default: $S24JAX_CACHE or ~/.cache/s24jax.
      "tfds_data_dir": config_dict.placeholder(str),  # Default: TFDS's own ($TFDS_DATA_DIR...).
      "val_fraction": DEFAULT_VAL_FRACTION,  # Share of documents held out.
      "text_key": "text",  # Feature (TFDS) or column / field (jsonl, parquet) of the text.
      "max_docs": config_dict.placeholder(int),  # Cap on documents per split (quick tests).
  })
