"""The perf tools' tests run their commands in process too: a command's error path
(s24jax/cli/command.py `run`) sets the SIGINT / SIGTERM handlers, which each test gets back
as pytest had them."""
import signal

import pytest


@pytest.fixture(autouse=True)
def _signal_handlers():
  saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  yield
  for s, h in saved.items():
    signal.signal(s, h)
