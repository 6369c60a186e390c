"""Fixtures of the data tests (tests/data/); plain helpers are in data_helpers.py."""

from __future__ import annotations

import pathlib
import socket

import pytest

from s24jax.data import cache

import data_helpers


@pytest.fixture(scope='module', autouse=True)
def no_network():
  """Any attempt to open a network connection fails the test instead of hanging on it (the
  tokenizer is built from local files; tiktoken's own 'gpt2' would download them).

  Module-scoped so that it is also active while module-scoped fixtures build datasets.
  """

  def refuse(*args, **kwargs):
    raise AssertionError(f'Network access attempted: {args}')

  with pytest.MonkeyPatch.context() as m:
    m.setattr(socket.socket, 'connect', refuse)
    m.setattr(socket, 'create_connection', refuse)
    yield


@pytest.fixture(scope='module')
def shakespeare(data_cache):
  """The embedded corpus in the session's shared test cache (built once per session):
  (the cache folder, its GPT-2 BPE tokens)."""
  cache_dir = pathlib.Path(data_cache)
  tokens = cache.load_tokens(data_helpers.cfg(cache_dir=str(cache_dir)))
  return cache_dir, tokens
