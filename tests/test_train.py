"""The training loop end to end on a tiny model: learning, resume, phases, errors."""
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import traverse_util

from s24jax import checkpoint as ckpt_lib
from s24jax import config_files
from s24jax import loop, phases, train
from s24jax import model as model_lib
from s24jax import state as state_lib

from tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(workdir):
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if "train/loss" in r:
        out[r["step"]] = r["train/loss"]
  return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_cache):
  workdir = str(tmp_path_factory.mktemp("full"))
  final = loop.train_and_evaluate(tiny_config("s_ste", steps=6, workdir_cache=data_cache), workdir)
  return workdir, final


def test_training_is_finite_and_reduces_loss(uninterrupted):
  workdir, final = uninterrupted
  losses = _losses(workdir)
  assert sorted(losses) == [1, 2, 3, 4, 5, 6]
  assert all(np.isfinite(v) for v in losses.values())
  assert losses[6] < losses[1] - 0.5, losses
  assert np.isfinite(final["val/loss"]) and 0 <= final["train/flip_rate"] <= 1
  for name in ("metrics.jsonl", "metrics.png", "config.json", "final_metrics.json"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(workdir, "tensorboard")))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4", "6"]


def test_stop_and_resume_gives_identical_losses(uninterrupted, tmp_path, data_cache):
  workdir = str(tmp_path / "resumed")
  loop.train_and_evaluate(tiny_config("s_ste", steps=6, workdir_cache=data_cache, stop_at_step=3),
                          workdir)
  assert sorted(_losses(workdir)) == [1, 2, 3]
  loop.train_and_evaluate(tiny_config("s_ste", steps=6, workdir_cache=data_cache), workdir)
  # step 3 was computed twice (after the kill the run resumes from the step-2 checkpoint)
  assert _losses(workdir) == _losses(uninterrupted[0])
  # The resumed run changed one field: its config names it (s24jax/workdir.py).
  with open(os.path.join(workdir, "config.resumed_at_2.json")) as f:
    resumed = json.load(f)
  assert resumed["changed"] == {"stop_at_step": {"was": 3, "now": -1}}
  assert resumed["config"]["total_steps"] == 6


def _tree_digest(path):
  h = hashlib.sha256()
  for root, _, files in sorted(os.walk(path)):
    for f in sorted(files):
      p = os.path.join(root, f)
      h.update(p.encode())
      with open(p, "rb") as fh:
        h.update(fh.read())
  return h.hexdigest()


def test_mismatched_checkpoint_is_a_clear_error_and_nothing_changes(uninterrupted, data_cache):
  workdir = uninterrupted[0]
  before = _tree_digest(workdir)
  cfg = tiny_config("s_ste", steps=8, workdir_cache=data_cache, model__d_model=64)
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match="does not match this config"):
    loop.train_and_evaluate(cfg, workdir)
  cfg = tiny_config("ste", steps=8, workdir_cache=data_cache)   # no 'scale' state for STE
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match="scale"):
    loop.train_and_evaluate(cfg, workdir)
  assert _tree_digest(workdir) == before


def test_dense_finetuning_switches_phase_and_starts_from_projected_weights(tmp_path, data_cache):
  cfg = tiny_config("ste", steps=4, workdir_cache=data_cache, sparsity__dense_finetune_fraction=0.5)
  workdir = str(tmp_path)
  loop.train_and_evaluate(cfg, workdir)
  recs = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  phase = {r["step"]: r["train/dense_phase"] for r in recs if "train/dense_phase" in r}
  assert phase == {1: 0.0, 2: 0.0, 3: 1.0, 4: 1.0}
  flips = {r["step"] for r in recs if "train/flip_rate" in r}
  assert flips == {1, 2}                                   # no mask in the dense phase


def test_entering_dense_finetuning_projected_or_latent():
  method, model_cfg, tx_fn = loop.build(tiny_config("s_ste"))
  st = train.fresh_state(model_lib.GPT2(model_cfg), tx_fn, 0)
  # 'latent' (the default, the reference code's): the dense phase continues from W itself.
  assert model_cfg.dense_twin().sparsity.dense_finetune_init == "latent"
  assert phases.enter(st, model_cfg, model_cfg.dense_twin()) is st
  dense = model_cfg.dense_twin()
  dense = dataclasses.replace(dense, sparsity=dataclasses.replace(
      dense.sparsity, dense_finetune_init="projected"))
  projected = phases.enter(st, model_cfg, dense).params
  for path in state_lib.sparse_layer_paths(st.sparsity):
    kernel = state_lib.get_path(st.params, path)["kernel"]
    layer = state_lib.get_path(st.sparsity, path)
    want = layer["scale"] * np.asarray(                     # beta * S(W), S per group of 4
        jax.vmap(lambda g: jnp.sign(g) * jnp.maximum(jnp.abs(g) - jnp.sort(jnp.abs(g))[1], 0))(
            kernel.reshape(-1, 4))).reshape(kernel.shape)
    np.testing.assert_allclose(state_lib.get_path(projected, path)["kernel"], want, rtol=1e-6)
  np.testing.assert_array_equal(projected["wte"]["embedding"], st.params["wte"]["embedding"])
  # Moving between two sparse models (e.g. an attention window) changes nothing.
  assert phases.enter(st, model_cfg, model_cfg) is st


_MULTI = r"""
import json, sys
sys.path.insert(0, {tests!r})
import jax
from s24jax import loop
from s24jax import phases
from tiny import tiny_config
assert jax.device_count() == 4, jax.devices()
loop.train_and_evaluate(tiny_config("sr_ste", steps=4, workdir_cache={cache!r},
                                    sparsity__sr_ste__decay=1e-2), {workdir!r})
"""


def test_four_devices_match_one_device(tmp_path, data_cache):
  one = str(tmp_path / "one")
  loop.train_and_evaluate(tiny_config("sr_ste", steps=4, workdir_cache=data_cache,
                                      sparsity__sr_ste__decay=1e-2), one)
  four = str(tmp_path / "four")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  script = _MULTI.format(tests=os.path.join(REPO, "tests"), cache=data_cache, workdir=four)
  subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=REPO, timeout=600)
  l1, l4 = _losses(one), _losses(four)
  assert sorted(l1) == sorted(l4) == [1, 2, 3, 4]
  np.testing.assert_allclose([l4[k] for k in l4], [l1[k] for k in l1], rtol=2e-5)


def _flat(config):
  return {k: v for k, v in traverse_util.flatten_dict(config.to_dict(), sep=".").items()
          if v is not None and not isinstance(v, (tuple, list))}


def test_sigkill_and_restart_reaches_the_same_losses(uninterrupted, tmp_path, data_cache):
  """A real SIGKILL in the middle of a run, then the same command again."""
  workdir = str(tmp_path / "killed")
  cmd = [sys.executable, os.path.join(REPO, "launch.py"), "--config",
         os.path.join(REPO, "experiments", "gpt2_s_ste.py") + ":tiny", "--workdir", workdir]
  # the test config, expressed as --config overrides of the experiment file's tiny variant
  want = _flat(tiny_config("s_ste", steps=6, workdir_cache=data_cache))
  have = _flat(config_files.load_config(cmd[3]))
  cmd += [f"--config.{k}={v}" for k, v in want.items() if have.get(k) != v]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(cmd + ["--config.stop_at_step=-1"], env=env, cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)
  ckpt2 = os.path.join(workdir, "checkpoints", "2")
  deadline = time.time() + 300
  while not os.path.exists(ckpt2) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL
  assert not os.path.exists(os.path.join(workdir, "final_metrics.json")), "killed too late"
  subprocess.run(cmd, env=env, cwd=REPO, check=True, timeout=600,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  assert _losses(workdir) == _losses(uninterrupted[0])
