"""Helpers shared by the tests that train the tiny model (tests/test_*.py): a model, train
state and batch for `train.train_step`, and the short S-STE run of the workdir tests (its
config, and its metrics.jsonl read back). The undisturbed run itself is the `undisturbed`
fixture of tests/conftest.py."""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from s24jax.nn import model as model_lib
from s24jax.training.run_spec import RunSpec

from tiny import tiny_config


def tiny_setup(method="dense", overrides=None):
  """(config, model, optimizer, fresh state, one batch of 8 random sequences) of the tiny
  model with `method` and `overrides`."""
  cfg = tiny_config(method, overrides={"batch_size": 8, **(overrides or {})})
  spec = RunSpec.build(cfg)
  model = model_lib.GPT2(spec.model_cfg)
  state = spec.fresh_state(0)
  tokens = np.random.default_rng(0).integers(0, 1000, (8, cfg.model.seq_len + 1))
  batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
           "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
  return cfg, model, spec.tx(state.params, state.sparsity), state, batch


# The run of the workdir tests (checkpoint, launch, workdir): S-STE for STEPS steps, logged
# every 5 steps, checkpointed only at the start and the end (unless overridden).
STEPS = 24
SETTINGS = {"log_every": 5, "checkpoint_every": 100}


def run_config(data_cache, steps=STEPS, **overrides):
  return tiny_config("s_ste", steps=steps, workdir_cache=data_cache,
                     overrides={**SETTINGS, **overrides})


def records(workdir):
  """The records of the run's metrics.jsonl, in order."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def losses(workdir):
  """{step: train/loss} of every logged step."""
  return {r["step"]: r["train/loss"] for r in records(workdir) if "train/loss" in r}


def assert_each_step_once(workdir):
  seen = {}
  for r in records(workdir):
    for k in r:
      if k != "step":
        assert (r["step"], k) not in seen, f"step {r['step']} {k} written twice"
        seen[(r["step"], k)] = True


def digest(path):
  """{relative path: hash of the content} of every file under `path`."""
  out = {}
  for root, _, files in os.walk(path):
    for name in files:
      p = os.path.join(root, name)
      with open(p, "rb") as f:
        out[os.path.relpath(p, path)] = hash(f.read())
  return out
