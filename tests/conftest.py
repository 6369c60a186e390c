"""Fixtures shared by every test folder, and tests/ on sys.path for its helper modules
(`tiny`, the tiny configs; `train_helpers`) from the subfolders (methods/, sparse_ops/,
kernels/, data/)."""
import fcntl
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_numerics  # noqa: E402  pylint: disable=wrong-import-position (tests/ on sys.path)

if gpu_numerics.enabled():   # S24JAX_TEST_GPU_NUMERICS=1: a GPU's TF32 dots and bf16 'auto'
  gpu_numerics.install()


@pytest.fixture
def f32_dots():
  """float32 dots at full float32 precision on every platform, for the tests that compare
  float32 math with tolerances derived for float32 (unit roundoff 2^-24). A CPU computes
  float32 dots in float32; a GPU from Ampere on, by default, in TF32 (each operand rounded to
  10 mantissa bits: a relative error up to 2^-11, 8192 times float32's), unless the dot's
  precision says otherwise. `S24JAX_TEST_GPU_NUMERICS=1` (gpu_numerics.py) shows on a CPU
  which tests need this. bfloat16 and FP8 dots are unaffected."""
  import jax  # pylint: disable=g-import-not-at-top
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
  """One token cache for the whole session (the embedded corpus is tokenized once)."""
  path = str(tmp_path_factory.mktemp("s24jax_cache"))
  return path


@pytest.fixture(scope="session")
def undisturbed(tmp_path_factory, data_cache):
  """The workdir of `train_helpers.run_config` trained without interruption, the reference of
  the resume tests (tests/training/test_checkpoint.py, tests/cli/test_launch.py). One run for the whole
  session: under pytest-xdist the workers share it (the first that needs it trains it under a
  file lock; the others wait, then read it). Tests only read it (one that must change it works
  on a copy): a change to it is an error at the end of the session."""
  import train_helpers  # pylint: disable=g-import-not-at-top (tests/ is on sys.path from here)
  from s24jax.training import loop  # pylint: disable=g-import-not-at-top

  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent                    # the base temp folder the workers' own ones are in
  workdir = root / "undisturbed"
  with open(root / "undisturbed.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (root / "undisturbed.done").exists():
      shutil.rmtree(workdir, ignore_errors=True)      # what a failed attempt left
      loop.train_and_evaluate(train_helpers.run_config(data_cache), str(workdir))
      (root / "undisturbed.done").touch()
  before = train_helpers.digest(workdir)
  yield str(workdir)
  assert train_helpers.digest(workdir) == before, "a test wrote into the undisturbed run"
