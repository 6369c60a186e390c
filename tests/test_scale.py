"""Scaling out: gradient accumulation, rematerialization, the chunked loss, sharded state over
a data x fsdp mesh, two processes on localhost, and a diverged run that loses nothing."""
import dataclasses
import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from s24jax import checkpoint as ckpt_lib
from s24jax import loop, losses, sharding, train
from s24jax import model as model_lib
from s24jax import state as state_lib

from tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(workdir, key="train/loss"):
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if key in r:
        out[r["step"]] = r[key]
  return out


def _setup(projection="dense", **overrides):
  cfg = tiny_config(projection, batch_size=8, **overrides)
  method, model_cfg, tx_fn = loop.build(cfg)
  model = model_lib.GPT2(model_cfg)
  state = train.init_state(model, tx_fn, 0)
  tokens = np.random.default_rng(0).integers(0, 1000, (8, cfg.model.seq_len + 1))
  batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
           "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
  return cfg, model, tx_fn(state.params, state.sparsity), state, batch


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("projection,overrides", [
    ("dense", {}),
    ("s_ste", {"sparsity__mvue": False, "sparsity__fp8": False}),
    ("t_sr_ste", {"sparsity__t_sr_ste__decay": 1e-2, "sparsity__t_sr_ste__mask_refresh_every": 2}),
])
def test_accumulation_is_the_same_math_as_one_big_batch(projection, overrides):
  cfg, model, tx, state, batch = _setup(projection, **overrides)
  runs = {}
  for k in (1, 4):
    st, losses_ = _copy(state), []
    for _ in range(3):
      st, m = train.train_step(st, batch, model=model, tx=tx, accum_steps=k)
      losses_.append(float(m["loss"]) / float(m["count"]))
    runs[k] = (st, losses_)
  np.testing.assert_allclose(runs[4][1], runs[1][1], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(runs[4][0].params), jax.tree.leaves(runs[1][0].params)):
    # Adam turns float-summation noise of near-zero gradients into O(lr) moves: tolerance ~lr/100
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  # the method's per-step state advanced once per step, not once per micro-batch
  assert int(runs[4][0].step) == 3
  for p in state_lib.sparse_layer_paths(runs[4][0].sparsity):
    np.testing.assert_array_equal(state_lib.get_path(runs[4][0].sparsity, p)["mask"],
                                  state_lib.get_path(runs[1][0].sparsity, p)["mask"])


def test_mvue_draws_an_independent_key_per_micro_batch():
  """With MVUE, accumulation over k micro-batches equals the sum of k separate gradients,
  micro-batch i (rows i, i+k, ...) drawn with fold_in(key, i): computed independently."""
  cfg, model, _, state, batch = _setup("s_ste", sparsity__mvue=True, sparsity__fp8=False)
  key = jax.random.key(7)
  total, grads = train.loss_and_grads(state.params, state.sparsity, batch, key, model=model,
                                      accum_steps=2)
  tokens = batch["targets"].size
  want_loss, want = 0.0, None
  for i in range(2):
    micro = {k: v[i::2] for k, v in batch.items()}
    f = lambda p, micro=micro, i=i: model.apply(
        {"params": p, "sparsity": state.sparsity}, micro["inputs"], micro["targets"],
        rngs={"sparsity": jax.random.fold_in(key, i)}) / tokens
    loss, g = jax.value_and_grad(f)(state.params)
    want_loss += float(loss) * tokens
    want = g if want is None else jax.tree.map(jnp.add, want, g)
  np.testing.assert_allclose(float(total), want_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # and the keys matter: the same key for both micro-batches gives another gradient
  _, same = train.loss_and_grads(state.params, state.sparsity, batch, key, model=model)
  fc = lambda g: state_lib.get_path(g, ("h_0", "mlp", "fc"))["kernel"]   # pylint: disable=unnecessary-lambda-assignment
  assert not np.allclose(fc(grads), fc(same))


@pytest.mark.parametrize("overrides", [{"loss_chunk": 24}, {"loss_chunk": 7, "remat": "full"},
                                       {"remat": "save_dots"}])
def test_chunked_loss_and_remat_equal_the_plain_model(overrides):
  cfg, model, _, state, batch = _setup("s_ste", sparsity__fp8=False)
  other = model_lib.GPT2(dataclasses.replace(model.config, **overrides))

  def value_and_grad(m):
    f = lambda p: m.apply({"params": p, "sparsity": state.sparsity}, batch["inputs"],
                          batch["targets"], rngs={"sparsity": jax.random.key(0)})
    return jax.jit(jax.value_and_grad(f))(state.params)

  (l0, g0), (l1, g1) = value_and_grad(model), value_and_grad(other)
  # the plain reference written out here: logits, then -log softmax at the targets
  logits = model.apply({"params": state.params, "sparsity": state.sparsity}, batch["inputs"])
  ref = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None],
                                     -1))
  np.testing.assert_allclose(float(l0), float(ref), rtol=1e-6)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_chunked_cross_entropy_pads_the_last_chunk():
  x = jax.random.normal(jax.random.key(0), (3, 5, 8))
  w = jax.random.normal(jax.random.key(1), (11, 8))
  t = jax.random.randint(jax.random.key(2), (3, 5), 0, 11)
  head = lambda h, i=None: h @ w.T   # pylint: disable=unnecessary-lambda-assignment
  plain = losses.cross_entropy_sum(head(x), t)
  for chunk in (1, 4, 15, 16, 64):
    np.testing.assert_allclose(float(losses.chunked_cross_entropy_sum(x, t, head, chunk)),
                               float(plain), rtol=1e-6)


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


_FSDP = r"""
import sys
sys.path.insert(0, {tests!r})
import jax
from s24jax import loop
from tiny import tiny_config
assert jax.device_count() == 8, jax.devices()
loop.train_and_evaluate(tiny_config("s_ste", steps=4, batch_size=8, workdir_cache={cache!r},
                                    sparsity__fp8=False, mesh__fsdp=8, stop_at_step={stop}),
                        {workdir!r})
"""


def test_fsdp_over_8_devices_matches_one_device_and_resumes_on_one(tmp_path, data_cache):
  one = str(tmp_path / "one")
  loop.train_and_evaluate(tiny_config("s_ste", steps=4, batch_size=8, workdir_cache=data_cache,
                                      sparsity__fp8=False), one)
  eight = str(tmp_path / "eight")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
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
  loop.train_and_evaluate(tiny_config("s_ste", steps=4, batch_size=8, workdir_cache=data_cache,
                                      sparsity__fp8=False), eight)
  np.testing.assert_allclose(_losses(eight)[4], l1[4], rtol=5e-5)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_on_localhost_match_one_process(tmp_path, data_cache):
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
      env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=2"), cwd=REPO,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=900)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
  assert "4 cpu device(s) in 2 process(es)" in outs[0]
  subprocess.run(launch + args + ["--workdir", str(tmp_path / "one")], check=True, cwd=REPO,
                 env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4"),
                 timeout=900, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  two, one = _losses(str(tmp_path / "two")), _losses(str(tmp_path / "one"))
  assert sorted(two) == [1, 2, 3]
  np.testing.assert_allclose([two[s] for s in two], [one[s] for s in two], rtol=2e-5)


def test_a_diverged_run_stops_and_keeps_a_finite_checkpoint(tmp_path, data_cache):
  workdir = str(tmp_path / "nan")
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "launch.py"), "--config",
       os.path.join(REPO, "experiments", "gpt2_dense.py") + ":tiny", "--workdir", workdir,
       "--config.optim.lr=1e6", "--config.optim.grad_clip=0", "--config.total_steps=40",
       "--config.checkpoint_every=10", "--config.batch_size=4", "--config.model.seq_len=16",
       "--config.model.num_layers=1", "--config.model.num_heads=2", "--config.model.d_model=32",
       f"--config.data.cache_dir={data_cache}"],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=900)
  assert proc.returncode == 1, proc.stderr[-3000:]
  msg = [l for l in proc.stderr.splitlines() if "not finite" in l]
  assert msg and "step " in msg[-1] and "last good checkpoint is step" in msg[-1], proc.stderr[-2000:]
  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")))
  assert steps, "a finite checkpoint is kept"
  cfg = tiny_config("dense", workdir_cache=data_cache)
  _, model_cfg, tx_fn = loop.build(cfg)
  fresh = train.init_state(model_lib.GPT2(model_cfg), tx_fn, 0)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
  for step in steps:   # every checkpoint left behind is finite
    ckpt = ckpt_lib.Checkpointer(workdir)
    restored = ckpt.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    ckpt.close()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.params))
  assert not os.path.exists(os.path.join(workdir, "final_metrics.json"))
