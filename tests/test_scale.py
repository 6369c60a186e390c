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


def _setup(method="dense", **overrides):
  cfg = tiny_config(method, batch_size=8, **overrides)
  method, model_cfg, tx_fn = loop.build(cfg)
  model = model_lib.GPT2(model_cfg)
  state = train.fresh_state(model, tx_fn, 0)
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
  grads_fn = jax.jit(train.loss_and_grads, static_argnames=("model", "accum_steps"))
  total, grads = grads_fn(state.params, state.sparsity, batch, key, model=model, accum_steps=2)
  tokens = batch["targets"].size
  one = jax.jit(jax.value_and_grad(lambda p, inputs, targets, k: model.apply(
      {"params": p, "sparsity": state.sparsity}, inputs, targets, rngs={"sparsity": k}) / tokens))
  want_loss, want = 0.0, None
  for i in range(2):
    loss, g = one(state.params, batch["inputs"][i::2], batch["targets"][i::2],
                  jax.random.fold_in(key, i))
    want_loss += float(loss) * tokens
    want = g if want is None else jax.tree.map(jnp.add, want, g)
  np.testing.assert_allclose(float(total), want_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # and the keys matter: the same key for both micro-batches gives another gradient
  _, same = grads_fn(state.params, state.sparsity, batch, key, model=model, accum_steps=1)
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
  fresh = train.fresh_state(model_lib.GPT2(model_cfg), tx_fn, 0)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
  for step in steps:   # every checkpoint left behind is finite
    ckpt = ckpt_lib.Checkpointer(workdir)
    restored = ckpt.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    ckpt.close()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.params))
  assert not os.path.exists(os.path.join(workdir, "final_metrics.json"))


def test_scanned_blocks_equal_the_unrolled_model():
  """model.scan_layers: the same network as the unrolled blocks when the stacked parameters
  and sparsity state are the unrolled ones stacked (an independent re-layout)."""
  cfg = tiny_config("s_ste", model__num_layers=3, sparsity__fp8=False, sparsity__mvue=False)
  _, model_cfg, _ = loop.build(cfg)
  unrolled = model_lib.GPT2(model_cfg)
  scanned = model_lib.GPT2(dataclasses.replace(model_cfg, scan_layers=True, remat="save_dots"))
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 1000)
  targets = jax.random.randint(jax.random.key(1), (2, 16), 0, 1000)
  v = unrolled.init(jax.random.key(2), tokens)

  def stack(tree):
    tree = dict(tree)
    layers = [tree.pop(f"h_{i}") for i in range(3)]
    tree["h"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return tree

  vs = {"params": stack(v["params"]), "sparsity": stack(v["sparsity"])}
  shapes = jax.eval_shape(scanned.init, jax.random.key(2), tokens)
  assert jax.tree.map(lambda x: x.shape, vs) == jax.tree.map(lambda x: x.shape, dict(shapes))
  f_u = lambda p: unrolled.apply({**v, "params": p}, tokens, targets)   # pylint: disable=unnecessary-lambda-assignment
  f_s = lambda p: scanned.apply({**vs, "params": p}, tokens, targets)   # pylint: disable=unnecessary-lambda-assignment
  (lu, gu) = jax.jit(jax.value_and_grad(f_u))(v["params"])
  (ls, gs) = jax.jit(jax.value_and_grad(f_s))(vs["params"])
  np.testing.assert_allclose(float(ls), float(lu), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(stack(gu))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # The method's per-layer work applies layer by layer to the stacked state: the S-STE
  # rescale gives each layer its own scale, and the flip rate counts every layer.
  method = dataclasses.replace(model_cfg.sparsity.method, rescale_every=1)
  before = state_lib.TrainState(step=jnp.asarray(0), params=vs["params"], opt_state=(),
                                sparsity=vs["sparsity"], method_state={},
                                rng=jax.random.key(0))
  new = method.update(before, before.replace(step=jnp.asarray(1)), None)[0].sparsity
  want = [float(s) for i in range(3) for s in [v["sparsity"][f"h_{i}"]["mlp"]["fc"]["scale"]]]
  w = [v["params"][f"h_{i}"]["mlp"]["fc"]["kernel"] for i in range(3)]
  from s24jax.methods import s_ste   # pylint: disable=g-import-not-at-top
  np.testing.assert_allclose(new["h"]["mlp"]["fc"]["scale"],
                             [float(s_ste.s_ste_scale(k)) for k in w], rtol=1e-6)
  assert len(set(np.round(want, 6))) == 3


@pytest.mark.aot
def test_planner_reports_memory_and_detects_xla_rematerialization(tmp_path):
  """The planner on a small S-STE config for an H100 (deviceless); then for an H100 shrunk to
  half of that step's memory need: it must not fit, the 16x-memory copy must show the true
  need (the first compile's total), and if XLA rematerialized to squeeze under the limit the
  planner must say so."""
  code = r"""
import json, sys
from s24jax import config_files, plan
from s24jax.kernels import aot
aot.start()
cfg = config_files.load_config(sys.argv[1], {"model.num_layers": 1, "model.num_heads": 2,
                                             "model.d_model": 64, "model.vocab_size": 512})
real = plan.plan(cfg, "h100", 1, search=False)
small = real["total_bytes_per_device"] // 2
plan.device_memory = lambda gpu: small
orig = plan._target_with_memory
plan._target_with_memory = lambda gpu, f: orig(gpu, 1).replace(
    "device_memory_size: 84978434048", f"device_memory_size: {small * f}")
tight = plan.plan(cfg, "h100", 1, search=True)
json.dump({"real": real, "tight": tight}, open(sys.argv[2], "w"))
"""
  out = tmp_path / "plans.json"
  subprocess.run([sys.executable, "-c", code,
                  os.path.join(REPO, "experiments", "gpt2_s_ste.py") + ":tiny", str(out)],
                 check=True, cwd=REPO, timeout=1200)
  r = json.loads(out.read_text())
  real, tight = r["real"], r["tight"]
  for key in ("fits", "total_bytes_per_device", "xla_rematerialized", "global_batch_tokens",
              "micro_batch", "grad_accum_steps", "flops_per_step"):
    assert key in real, key
  assert real["fits"] and not real["xla_rematerialized"]
  assert real["global_batch_tokens"] == 16 * 64 and real["micro_batch"] == 16
  assert real["grad_accum_steps"] == 1
  assert real["total_bytes_per_device"] == (real["argument_size_in_bytes"]
                                           + real["output_size_in_bytes"]
                                           - real["alias_size_in_bytes"]
                                           + real["temp_size_in_bytes"])
  # the forward/backward matmuls: about 6 N tokens (here the 64-wide head and attention too)
  assert 0.8 < real["flops_per_step"] / (6 * real["params"] * 1024) < 3.0
  assert not tight["fits"]
  assert tight["total_bytes_without_xla_remat"] == real["total_bytes_per_device"]
  if tight["xla_rematerialized"]:
    assert tight["total_bytes_per_device"] < tight["total_bytes_without_xla_remat"]
  best = tight["largest_fitting_micro_batch"]
  assert best is None or best < 16
