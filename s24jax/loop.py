"""`train_and_evaluate(config, workdir)`: data, init, restore, the step loop, eval, logging.

The loop is plain Python around two compiled steps: the sparse step and (for dense
fine-tuning) a dense twin compiled from the same model with `projection='dense'`, so the
dense phase runs at dense speed instead of branching inside one step.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from s24jax import act_sparsity
from s24jax import checkpoint as ckpt_lib
from s24jax import config as config_lib
from s24jax import data as data_lib
from s24jax import decay_control
from s24jax import flip_monitor
from s24jax import flops as flops_lib
from s24jax import metrics as metrics_lib
from s24jax import mst
from s24jax import optim
from s24jax import projections
from s24jax import schedules
from s24jax import state as state_lib
from s24jax import train
from s24jax.model import GPT2, flops_per_token, num_params


def make_mesh(devices=None) -> Mesh:
  """A 1-D data-parallel mesh over all devices (all hosts)."""
  devices = np.asarray(devices if devices is not None else jax.devices())
  return Mesh(devices.reshape(-1), ("data",))


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """This process's rows of the global batch -> global arrays sharded on 'data'."""
  sharding = NamedSharding(mesh, P("data"))
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def build(config: ml_collections.ConfigDict):
  """Models (sparse, dense twin), the optimizer factory and a fresh state."""
  model = GPT2(config_lib.model_config(config))
  dense_model = GPT2(config_lib.model_config(config, dense=True))
  proj = projections.get_projection(config.sparsity.projection)

  def tx_fn(params, sparsity):
    return optim.make_optimizer(config, state_lib.is_sparse_kernel(params, sparsity), proj.mask)

  return model, dense_model, tx_fn


def attention_twins(config, model: GPT2, dense_model: GPT2):
  """step -> (model, dense twin) with that step's attention pattern (MST Hybrid Sparse
  Attention): one compiled step per pattern, built once so the jit cache is reused."""
  twins = {model.config.attention: (model, dense_model)}
  start, end = mst.attention_window(config)
  if end > start:
    pattern = config.mst.sparse_attention
    if pattern not in twins:
      twins[pattern] = tuple(GPT2(dataclasses.replace(m.config, attention=pattern))
                             for m in (model, dense_model))
  return lambda step: twins[mst.attention_at(config, step)]


def _local_batch(tokens, config, step: int) -> dict[str, np.ndarray]:
  """This process's share of the global batch of `step` (a pure function of seed, step)."""
  b = data_lib.batch_at(tokens, seed=config.seed, step=step, batch_size=config.batch_size,
                        seq_len=config.model.seq_len)
  n, i = jax.process_count(), jax.process_index()
  per = config.batch_size // n
  return {k: v[i * per:(i + 1) * per] for k, v in b.items()}


def evaluate(params, sparsity, model, val_batches, mesh) -> float:
  loss, count = 0.0, 0.0
  for b in val_batches:
    m = train.eval_step(params, sparsity, shard_batch(b, mesh), model=model)
    loss, count = loss + float(m["loss"]), count + float(m["count"])
  return loss / max(count, 1.0)


def _write_config(workdir: str, config: ml_collections.ConfigDict, step: int) -> None:
  """Saves the resolved config; never overwrites the one the run started with."""
  path = os.path.join(workdir, "config.json")
  if os.path.exists(path):
    path = os.path.join(workdir, f"config.resumed_at_{step}.json")
  with open(path, "w", encoding="utf-8") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))


def _summarise(metric_list: list[dict], elapsed: float, tokens: int, fpt: float,
               peak: float | None) -> dict[str, float]:
  """Host-side reduction of the (fetched) metrics of the last log interval."""
  host = metric_list
  out = {"train/loss": float(sum(m["loss"] for m in host) / sum(m["count"] for m in host)),
         "train/grad_norm": float(np.mean([m["grad_norm"] for m in host]))}
  for k in host[-1]:
    if k.startswith("flip_rate") or k == "transposable_kept_ratio":
      # NaN = no measurement at that step (cached masks measure only at refreshes).
      values = np.asarray([m[k] for m in host], np.float64)
      if not np.isnan(values).all():
        out[f"train/{k}"] = float(np.nanmean(values))
    elif k.startswith("sparsity/"):   # projection state (S-STE scale): its latest value
      out[f"train/{k}"] = float(host[-1][k])
  tps = tokens / max(elapsed, 1e-9)
  out["perf/tokens_per_sec"] = tps
  out["perf/mfu"] = metrics_lib.mfu(tps, fpt, peak, jax.device_count())
  return out


def _act_title(config) -> str:
  """' + venom act 64:2:8' (V:N:M) when the FFN activations are sparse (act_sparsity.py)."""
  sp = config.sparsity
  if sp.act_sparsity == "none":
    return ""
  return f" + {sp.act_sparsity} act {sp.act_v}:{sp.act_n}:{sp.act_m}"


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains per `config`, resuming from `workdir` if it holds a checkpoint. Returns finals."""
  os.makedirs(workdir, exist_ok=True)
  mesh = make_mesh()
  if config.batch_size % jax.device_count():
    raise ValueError(f"batch_size={config.batch_size} is not divisible by the "
                     f"{jax.device_count()} devices")
  data = data_lib.load_tokens(config.data)
  val_batches = data_lib.eval_batches(data.val, batch_size=config.batch_size,
                                      seq_len=config.model.seq_len,
                                      num_batches=config.eval_batches)
  unigram = data_lib.unigram_entropy(data.train)

  model, dense_model, tx_fn = build(config)
  replicated = NamedSharding(mesh, P())
  fresh = jax.jit(lambda: train.init_state(model, tx_fn, config.seed),
                  out_shardings=replicated)()
  tx = tx_fn(fresh.params, fresh.sparsity)
  ckpt = ckpt_lib.Checkpointer(workdir, keep=config.keep_checkpoints)
  state = ckpt.restore_or_init(fresh)
  del fresh
  start = int(state.step)
  total = config.total_steps
  final_path = os.path.join(workdir, "final_metrics.json")
  if start >= total and os.path.exists(final_path):
    logging.info("%s already trained to step %d >= total_steps=%d; nothing to do",
                 workdir, start, total)
    ckpt.close()
    with open(final_path, encoding="utf-8") as f:
      return json.load(f)
  _write_config(workdir, config, start)

  dense_from = schedules.dense_finetune_start(total, config.sparsity.dense_finetune_fraction)
  n_params = num_params(state.params)
  fpt = flops_per_token(model.config, n_params)
  peak = config.peak_flops or metrics_lib.device_peak_flops()
  tokens_per_step = config.batch_size * config.model.seq_len
  lr_fn = jax.jit(schedules.learning_rate(config.optim, total))   # one compile, not one per op
  writer = metrics_lib.MetricWriter(workdir)
  if start == 0:
    writer.write(0, {"data/unigram_entropy": unigram, "model/params": n_params,
                     "model/sparse_weights": state_lib.num_sparse_weights(state.params,
                                                                          state.sparsity)})
  logging.info("params %.2fM, unigram entropy %.3f nats, %d devices, resume at step %d",
               n_params / 1e6, unigram, jax.device_count(), start)
  # MST (s24jax/mst.py): topology updates between steps, per-step attention pattern; and the
  # training FLOP count of every run (s24jax/flops.py), restarted from the plan on resume.
  models_at = attention_twins(config, model, dense_model)
  mst_ctl = mst.Controller(config, state) if mst.enabled(config) else None
  nnz = mst_ctl.active_counts(state) if mst_ctl else {}
  flop_acct = flops_lib.planned(config, upto=start)

  sparsity_cfg = model.config.sparsity
  flip_warn = flip_monitor.FlipRateMonitor(sparsity_cfg.flip_rate_warn,
                                           sparsity_cfg.flip_rate_warn_patience)
  # lambda_W chosen during warm-up (s24jax/decay_control.py): logged when it is frozen.
  decay_frozen_at = (sparsity_cfg.decay_auto_steps if decay_control.enabled(sparsity_cfg)
                     else -1)

  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  bar = tqdm(total=total, initial=start, dynamic_ncols=True, disable=jax.process_index() != 0,
             mininterval=1.0)
  postfix: dict[str, str] = {}
  pending: list[dict] = []
  t_last, step_last = time.time(), start
  final: dict[str, float] = {}
  last_val = None
  step = start
  while step < total:
    if step == config.stop_at_step:
      logging.warning("stop_at_step=%d reached: leaving without a final checkpoint", step)
      break
    dense = step >= dense_from
    model, dense_model = models_at(step)
    if dense and step == dense_from and not projections.get_projection(
        config.sparsity.projection).is_dense:
      state = state.replace(params=train.project_params(model, state.params, state.sparsity))
      logging.info("step %d: switching to dense fine-tuning", step)
    batch = shard_batch(_local_batch(data.train, config, step), mesh)
    if config.act_stats_sequences and ((step + 1) % config.log_every == 0 or step + 1 == total):
      # The activations this step trains on (params before the update), one extra forward;
      # its time is not charged to tokens/s (synchronised on both sides, log steps only).
      jax.block_until_ready(state.params)
      t_stats = time.time()
      act_stats = jax.block_until_ready(act_sparsity.activation_stats(
          state.params, state.sparsity, batch["inputs"], model=dense_model if dense else model,
          num_sequences=min(config.act_stats_sequences, config.batch_size)))
      t_last += time.time() - t_stats
    updated = mst_ctl is not None and not dense and mst_ctl.due(step)
    if updated:
      state, mst_scalars = mst_ctl.update(state, batch, step, model=model)
      writer.write(step, mst_scalars)
      nnz = mst_ctl.targets(step)   # == the active counts (Controller.update checks)
    flop_acct.add({} if dense else nnz, model.config.attention, topology_update=updated)
    state, m = train.train_step(state, batch, model=dense_model if dense else model, tx=tx)
    pending.append(m)
    step += 1
    if step == decay_frozen_at:
      chosen = float(state.sparsity[decay_control.KEY]["decay"])
      logging.info("step %d: end of the lambda_W warm-up controller; lambda_W frozen at %.4g",
                   step, chosen)
      writer.write(step, {"sparsity/decay_chosen": chosen})
      final["sparsity/decay_chosen"] = chosen

    if step % config.log_every == 0 or step == total:
      pending = jax.device_get(pending)   # wait for the steps before reading the clock
      now = time.time()
      scalars = _summarise(pending, now - t_last, (step - step_last) * tokens_per_step,
                           fpt, peak)
      scalars["train/lr"] = float(lr_fn(step - 1))
      scalars["train/dense_phase"] = float(dense)
      if not dense and not projections.get_projection(config.sparsity.projection).is_dense:
        scalars["train/flip_rate_warning"] = flip_warn.update(step,
                                                              scalars.get("train/flip_rate"))
      scalars.update(flop_acct.scalars())
      if config.act_stats_sequences:
        scalars.update({k: float(v) for k, v in jax.device_get(act_stats).items()})
      pending, t_last, step_last = [], now, step
      writer.write(step, scalars)
      final.update(scalars)
      postfix.update(loss=f"{scalars['train/loss']:.3f}",
                     tok_s=f"{scalars['perf/tokens_per_sec']:.0f}")
      if "train/flip_rate" in scalars:
        postfix["flip"] = f"{scalars['train/flip_rate']:.2e}"
    if step % config.eval_every == 0 or step == total:
      last_val = evaluate(state.params, state.sparsity, dense_model if dense else model,
                          val_batches, mesh)
      writer.write(step, {"val/loss": last_val})
      final["val/loss"] = last_val
      postfix["val"] = f"{last_val:.3f}"
      t_last = time.time()  # do not charge eval time to tokens/s (eval blocks on the state)
    if step % config.checkpoint_every == 0 or step == total:
      t_save = time.time()
      ckpt.save(step, state, force=True)   # async write; the device->host copy blocks
      t_last += time.time() - t_save
    bar.set_postfix(postfix, refresh=False)
    bar.update(1)
  bar.close()
  ckpt.close()
  writer.close()
  metrics_lib.plot(writer.jsonl_path, os.path.join(workdir, "metrics.png"),
                   title=f"{config.sparsity.projection}{_act_title(config)} | "
                         f"{model.config.num_layers}L {model.config.d_model}d")
  final.update(flops_lib.summary(flop_acct))
  if mst_ctl is not None:
    records = metrics_lib.read_jsonl(writer.jsonl_path)
    steps_, sparsity_ = metrics_lib.series(records, "mst/sparsity")
    mst.plot_schedule(config, os.path.join(workdir, "mst_schedule.png"),
                      measured={"step": steps_, "sparsity": sparsity_})
  final["data/unigram_entropy"] = unigram
  final["step"] = step
  with open(final_path, "w", encoding="utf-8") as f:
    json.dump({k: float(v) for k, v in final.items() if v is not None}, f, indent=2)
  return final
