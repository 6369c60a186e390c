"""Tests for s24jax/training/sharding.py: the mesh shapes and the state's partition rules (specs
written out by hand), and sharded training against one device as the reference: 4 data-
parallel devices, 8-way FSDP (which also resumes on one device), and two processes on
localhost against one process, each reaching the one-device losses."""
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from s24jax.training import loop
from s24jax.training import sharding

from tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _devices(n: int) -> str:
  """XLA_FLAGS for n CPU devices, keeping the suite's (conftest.py)."""
  return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()


def _losses(workdir, key="train/loss"):
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if key in r:
        out[r["step"]] = r[key]
  return out


def test_sharding_rules():
  assert sharding.make_mesh(None, jax.devices()[:1]).shape == {"data": 1, "fsdp": 1}
  assert sharding.mesh_shape(8, -1, 1) == (8, 1)
  assert sharding.mesh_shape(8, -1, 4) == (2, 4)
  assert sharding.mesh_shape(8, 2, -1) == (2, 4)
  with pytest.raises(ValueError, match="use the 8 devices exactly"):
    sharding.mesh_shape(8, 3, -1)

  class Fake:   # a 4-way fsdp "mesh" for the spec rules only
    shape = {"data": 1, "fsdp": 4}

  p = sharding.Partitioner.__new__(sharding.Partitioner)
  object.__setattr__(p, "mesh", Fake())
  P = jax.sharding.PartitionSpec
  assert p.spec("params/h_0/mlp/fc/kernel", (512, 128)) == P("fsdp")
  assert p.spec("opt_state/1/0/mu/h_0/mlp/fc/kernel", (512, 128)) == P("fsdp")
  assert p.spec("sparsity/h_0/mlp/fc/mask", (512, 128)) == P("fsdp")
  assert p.spec("params/wte/embedding", (50304, 128)) == P("fsdp")
  assert p.spec("params/h_0/mlp/fc/bias", (512,)) == P()            # biases replicated
  assert p.spec("sparsity/h_0/mlp/fc/scale", ()) == P()
  assert p.spec("params/h_0/attn/qkv/kernel", (6, 128)) == P()      # 6 % 4: replicated


_MULTI = r"""
import json, sys
sys.path.insert(0, {tests!r})
import jax
from s24jax.training import loop
from tiny import tiny_config
assert jax.device_count() == 4, jax.devices()
loop.train_and_evaluate(tiny_config("sr_ste", steps=4, workdir_cache={cache!r},
                                    overrides={{"sparsity.sr_ste.decay": 1e-2}}), {workdir!r})
"""


@pytest.mark.slow
def test_four_devices_match_one_device(tmp_path, data_cache):
  one = str(tmp_path / "one")
  loop.train_and_evaluate(tiny_config("sr_ste", steps=4, workdir_cache=data_cache,
                                      overrides={"sparsity.sr_ste.decay": 1e-2}), one)
  four = str(tmp_path / "four")
  env = dict(os.environ, XLA_FLAGS=_devices(4), JAX_PLATFORMS="cpu")
  script = _MULTI.format(tests=os.path.join(REPO, "tests"), cache=data_cache, workdir=four)
  subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=REPO, timeout=600)
  l1, l4 = _losses(one), _losses(four)
  assert sorted(l1) == sorted(l4) == [1, 2, 3, 4]
  np.testing.assert_allclose([l4[k] for k in l4], [l1[k] for k in l1], rtol=2e-5)


_FSDP = r"""
import sys
sys.path.insert(0, {tests!r})
import jax
from s24jax.training import loop
from tiny import tiny_config
assert jax.device_count() == 8, jax.devices()
loop.train_and_evaluate(tiny_config("s_ste", steps=4, workdir_cache={cache!r},
                                    overrides={{"batch_size": 8, "sparsity.fp8": False,
                                               "mesh.fsdp": 8, "stop_at_step": {stop}}}),
                        {workdir!r})
"""


@pytest.mark.slow
def test_fsdp_over_8_devices_matches_one_device_and_resumes_on_one(tmp_path, data_cache):
  one = str(tmp_path / "one")
  overrides = {"batch_size": 8, "sparsity.fp8": False}
  loop.train_and_evaluate(tiny_config("s_ste", steps=4, workdir_cache=data_cache,
                                      overrides=overrides), one)
  eight = str(tmp_path / "eight")
  env = dict(os.environ, XLA_FLAGS=_devices(8),
             JAX_PLATFORMS="cpu")
  script = _FSDP.format(tests=os.path.join(REPO, "tests"), cache=data_cache, workdir=eight,
                        stop=3)
  subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=REPO, timeout=900)
  l1, l8 = _losses(one), _losses(eight)
  assert sorted(l8) == [1, 2, 3]
  np.testing.assert_allclose([l8[s] for s in (1, 2, 3)], [l1[s] for s in (1, 2, 3)], rtol=5e-5)
  m1 = _losses(one, "memory/state_bytes_per_device")[0]
  m8 = _losses(eight, "memory/state_bytes_per_device")[0]
  assert 7.5 <= m1 / m8 <= 8.0, (m1, m8)   # a few replicated biases and scalars
  # The 8-device checkpoint (step 2) resumes on this 1-device process and continues exactly.
  loop.train_and_evaluate(tiny_config("s_ste", steps=4, workdir_cache=data_cache,
                                      overrides=overrides), eight)
  np.testing.assert_allclose(_losses(eight)[4], l1[4], rtol=5e-5)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_on_localhost_match_one_process(tmp_path):
  """jax.distributed over a loopback coordinator, gloo CPU collectives, 2 x 2 devices, vs one
  process with 4 devices: the same losses; the token cache is prepared once, behind a barrier."""
  cache = str(tmp_path / "fresh_cache")   # a cold cache: process 0 prepares, process 1 waits
  args = ["--config", os.path.join(REPO, "experiments", "gpt2_dense.py") + ":tiny",
          "--config.total_steps=3", "--config.batch_size=8", "--config.model.seq_len=16",
          "--config.model.num_layers=1", "--config.model.num_heads=2",
          "--config.model.d_model=32", "--config.log_every=1", "--config.eval_every=3",
          "--config.eval_batches=1", "--config.checkpoint_every=3",
          f"--config.data.cache_dir={cache}"]
  launch = [sys.executable, os.path.join(REPO, "launch.py")]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  port = _free_port()
  procs = [subprocess.Popen(
      launch + args + ["--workdir", str(tmp_path / "two"), "--distributed",
                       f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                       f"--process_id={i}"],
      env=dict(env, XLA_FLAGS=_devices(2)), cwd=REPO,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=900)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
  assert "4 cpu device(s) in 2 process(es)" in outs[0]
  subprocess.run(launch + args + ["--workdir", str(tmp_path / "one")], check=True, cwd=REPO,
                 env=dict(env, XLA_FLAGS=_devices(4)),
                 timeout=900, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  two, one = _losses(str(tmp_path / "two")), _losses(str(tmp_path / "one"))
  assert sorted(two) == [1, 2, 3]
  np.testing.assert_allclose([two[s] for s in two], [one[s] for s in two], rtol=2e-5)
