"""`train_and_evaluate(config, workdir)`: the training loop, a few lines around chores.

Set-up: the whole run is checked before anything is written (s24jax/training/validate.py), which
builds it once (`RunSpec`: the method, the model config, the facts, the state's shapes) and
its data; `Run.create` makes the state (restored from the newest readable checkpoint, step 0
included). The loop then, for every step: decides what the step is (`StepInfo`: its index,
whether it is logged), picks the step's model (the method's phases: dense fine-tuning,
attention windows; one compiled step per distinct model), runs the due "before" chores, the
jitted train step, and the due "after" chores: log, eval, checkpoint, FLOP accounting,
activation statistics and the method's own (s24jax/chores.py). Nothing here names a method."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
from absl import logging
from tqdm import tqdm

from s24jax.training import checkpoint as ckpt_lib
from s24jax.data import batches
from s24jax import chores as chores_lib
from s24jax import destinations
from s24jax import errors
from s24jax.training import init_from
from s24jax.training import fit
from s24jax.training import flops as flops_lib
from s24jax.training import diagnostics
from s24jax.training import model_schedule
from s24jax.training import preemption
from s24jax import metrics as metrics_lib
from s24jax.nn import model as model_lib
from s24jax.training import schedules
from s24jax.training import sharding
from s24jax import state as state_lib
from s24jax.training import train
from s24jax.training import validate
from s24jax.training import workdir as workdir_lib
from s24jax.methods import base as methods_base
from s24jax.training.run_spec import RunSpec
from s24jax.step_info import StepInfo


class NonFiniteError(errors.KnownError, RuntimeError):
  """Training produced a non-finite loss or gradient norm; nothing non-finite was saved."""
  exit_code = errors.EXIT_NON_FINITE


def shard_batch(batch: dict[str, np.ndarray], partitioner: sharding.Partitioner
                ) -> dict[str, jax.Array]:
  """This process's rows of the global batch -> global arrays split over the mesh."""
  return {k: jax.make_array_from_process_local_data(partitioner.batch, v)
          for k, v in batch.items()}


def local_batch(tokens, config, step: int) -> dict[str, np.ndarray]:
  """This process's share of the global batch of `step` (a pure function of seed, step)."""
  b = batches.batch_at(tokens, seed=config.seed, step=step, batch_size=config.batch_size,
                       seq_len=config.model.seq_len)
  n, i = jax.process_count(), jax.process_index()
  per = config.batch_size // n
  return {k: v[i * per:(i + 1) * per] for k, v in b.items()}


def evaluate(params, sparsity, model, val_batches, partitioner) -> float:
  loss, count = 0.0, 0.0
  for b in val_batches:
    m = train.eval_step(params, sparsity, shard_batch(b, partitioner), model=model)
    loss, count = loss + float(m["loss"]), count + float(m["count"])
  return loss / max(count, 1.0)


@dataclasses.dataclass
class Run:
  """The run as the loop holds it; the chores see it through `chores.Context`."""
  spec: RunSpec                     # what the run trains, built once
  workdir: str
  partitioner: sharding.Partitioner
  data: Any
  model_cfg: model_lib.ModelConfig  # the model of the current step (s24jax/training/model_schedule.py)
  tx: Any
  state: Any
  ckpt: ckpt_lib.Checkpointer
  writer: metrics_lib.MetricWriter
  step: int = 0                     # optimizer steps done (= the index of the next step)
  info: StepInfo | None = None      # the step in flight (chores see it before and after)
  batch: Any = None
  clock: chores_lib.Clock = dataclasses.field(default_factory=chores_lib.Clock)
  pending: list = dataclasses.field(default_factory=list)   # metrics since the last log
  last_log: dict = dataclasses.field(default_factory=dict)
  final: dict = dataclasses.field(default_factory=dict)
  postfix: dict = dataclasses.field(default_factory=dict)   # the progress bar's fields
  first: fit.FirstStep | None = None   # the first model's step, compiled before anything ran
  _models: dict = dataclasses.field(default_factory=dict)

  @property
  def config(self) -> ml_collections.ConfigDict:
    return self.spec.config

  @property
  def facts(self) -> methods_base.RunFacts:
    return self.spec.facts

  @property
  def method(self) -> methods_base.Method:
    """The run's method (a phase may train another model: `model_cfg`)."""
    return self.spec.method

  @property
  def base_cfg(self) -> model_lib.ModelConfig:
    """The run's model (the method's, before any phase)."""
    return self.spec.model_cfg

  @property
  def total(self) -> int:
    return self.facts.total_steps

  @property
  def model(self):
    """The step's model, one instance per distinct config (so the jit cache is reused)."""
    return self._models.setdefault(self.model_cfg, model_lib.build(self.model_cfg))

  @property
  def metrics_path(self) -> str:
    return self.writer.jsonl_path

  @property
  def sparse_phase(self) -> bool:
    return self.model_cfg.sparsity.method.sparse

  def train_step(self, state, batch, info: StepInfo):
    """One optimizer step of the current model: the executable compiled (and checked to fit)
    before the run started, while the run trains that model; else the jitted step."""
    if self.first is not None and self.first.model_cfg == self.model_cfg:
      return self.first.compiled(state, batch, info)
    return train.train_step(state, batch, info, model=self.model, tx=self.tx,
                            accum_steps=self.config.grad_accum_steps,
                            partitioner=self.partitioner)

  def write(self, step: int, scalars: dict[str, Any]) -> None:
    self.writer.write(step, scalars)
    self.final.update(scalars)

  def set_model(self, step: int) -> None:
    """Moves to the model of `step`; leaving a model may change the state (dense twin)."""
    new = model_schedule.model_at(step, self.base_cfg, self.facts)
    if new != self.model_cfg:
      logging.info("step %d: switching to the model %s", step, new.describe())
      self.state = model_schedule.enter(self.state, self.model_cfg, new)
      self.model_cfg = new

  @classmethod
  def create(cls, config: ml_collections.ConfigDict, workdir: str, checked: validate.Checked,
             first: fit.FirstStep | None = None):
    """The run of a checked config (`validate.check_run`): the first writes to the workdir."""
    spec = checked.spec
    partitioner = sharding.Partitioner(checked.mesh)
    fresh = jax.jit(spec.fresh_state,
                    out_shardings=partitioner.state_shardings(spec.abstract_state))()
    os.makedirs(workdir, exist_ok=True)
    ckpt = ckpt_lib.Checkpointer(workdir, keep=config.keep_checkpoints)
    state = ckpt.restore_or_init(fresh)
    if ckpt.latest_step() is None and config.get("init_from"):   # a new run: start from there
      state = init_from.init_from_hf(spec, state, config.init_from,
                                  shardings=partitioner.state_shardings(spec.abstract_state))
    step = int(state.step)
    if step == 0 and jax.process_index() == 0:
      workdir_lib.supersede_metrics(workdir)   # what an attempt before its first checkpoint logged
    # The model the last step (index step - 1) trained, so that resuming into a new phase
    # enters it.
    current = model_schedule.model_at(step - 1, spec.model_cfg, spec.facts) if step else spec.model_cfg
    run = cls(spec=spec, workdir=workdir, partitioner=partitioner,
              data=checked.data, model_cfg=current,
              tx=spec.tx(fresh.params, fresh.sparsity), state=state, ckpt=ckpt,
              writer=metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0,
                                              resume_step=step),
              step=step, first=first)
    run.final.update(run.writer.history)            # a resumed run's history so far
    run.pending.extend(preemption.load_pending(workdir, step))   # the steps a preemption left unlogged
    return run


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       allow_unmatched_layers: bool = False,
                       on_start: Callable[[], None] | None = None,
                       source: str = "") -> dict[str, float]:
  """Trains per `config`, resuming from `workdir` if it holds a checkpoint. Returns finals.
  Holds the workdir's lock, checks the whole run before writing anything (validate.py;
  `allow_unmatched_layers`: unmatched sparse-layer patterns only warn), compiles the first
  step and checks that it fits the device's memory (fit.py: DoesNotFit, exit code 6, naming
  the nearest setting that fits; `source`: the config file, for that message), then calls
  `on_start()` (launch.py opens train.log there). SIGTERM / SIGINT stop it after the step in
  flight, its checkpoint saved (preemption.Preempted); in its last step it ends as it would."""
  primary = jax.process_index() == 0
  lock = workdir_lib.WorkdirLock(workdir) if primary else contextlib.nullcontext()
  with lock, preemption.Guard() as guard:
    with guard.at_once():   # a signal during the checks stops at once: nothing written yet
      checked = validate.check_run(config, workdir, allow_unmatched_layers=allow_unmatched_layers)
      first = fit.first_step(config, checked, workdir, source=source)   # fits, or exit 6
    if on_start is not None:
      on_start()
    run = Run.create(config, workdir, checked, first)
    final_path = os.path.join(workdir, "final_metrics.json")
    if run.step >= run.total and os.path.exists(final_path):
      logging.info("%s already trained to step %d; nothing to do", workdir, run.step)
      _close(run)
      guard.stop_if_asked(run.step)   # a signal while it started said so (exit code 75)
      with open(final_path, encoding="utf-8") as f:
        return json.load(f)
    if primary:
      workdir_lib.write_config(workdir, config, run.step, data=run.data)
    chores = standard_chores(run)
    bar = tqdm(total=run.total, initial=run.step, dynamic_ncols=True, mininterval=1.0,
               disable=not primary)
    in_flight = None   # the metrics of the step before the one just dispatched
    end = config.stop_at_step if run.step <= config.stop_at_step else run.total   # the last
    with _closing(run, bar):
      while run.step < run.total and run.step != config.stop_at_step:
        run.info = StepInfo.at(run.step, log_every=config.log_every, total=run.total)
        run.set_model(run.step)
        run.batch = shard_batch(local_batch(run.data.train, config, run.step), run.partitioner)
        chores_lib.run_chores(run, chores, before_step=True)
        run.state, metrics = run.train_step(run.state, run.batch, run.info)
        run.pending.append(metrics)
        run.step = run.info.next_step
        chores_lib.run_chores(run, chores, before_step=False)
        bar.set_postfix(run.postfix, refresh=False)
        bar.update(1)
        # At most two steps queued on the device (this one runs while the next is prepared),
        # so a signal stops the run within a step or two at any log_every.
        jax.block_until_ready(in_flight)
        in_flight = metrics
        run.ckpt.poll()   # a failed save (a full disk) stops the run now, not at the next one
        if run.step < run.total and guard.should_stop(run.step, end):
          save_and_stop(run, guard)
  if run.step == config.stop_at_step:
    logging.warning("stop_at_step=%d reached: leaving without a final checkpoint", run.step)
  elif primary:
    with _closing(run), destinations.writing(final_path, "The checkpoints are intact."):
      destinations.write_atomic(final_path, json.dumps(   # a torn file would block the next run
          {k: float(v) for k, v in run.final.items() if v is not None}, indent=2))
  guard.stop_if_asked(run.step)   # a stop said with no check left before the end: as said
  return run.final


def _close(run: "Run") -> None:
  try:
    run.ckpt.close()
  finally:
    run.writer.close()


@contextlib.contextmanager
def _closing(run: "Run", bar: Any = None):
  """Closes the bar, the checkpointer and the writers (if a bar is given) however the block
  ends: the error that stopped the run is raised, not a failure to close after it (logged);
  a full disk met by the run's own writes stops it as a failed save does."""
  error = None
  try:
    yield
  except BaseException as e:   # pylint: disable=broad-except
    error = e
  if bar is not None:
    bar.close()
    try:
      _close(run)
    except Exception as e:   # pylint: disable=broad-except
      if error is not None:
        logging.warning("closing the checkpoints and logs after %s failed too: %s",
                        type(error).__name__, e)
      error = error or e
  if isinstance(error, OSError) and error.errno in ckpt_lib.DISK_FULL:
    raise run.ckpt.disk_full(error) from error
  if error is not None:
    raise error


def save_and_stop(run: "Run", guard: preemption.Guard) -> None:
  """A signal asked to stop after `run.step`: the checkpoint of that step (waited for), the
  metrics of the steps since the last log (so the resumed run logs what an uninterrupted
  one would), then `Preempted`."""
  pending = jax.device_get(run.pending)
  check_finite(run, pending)
  run.ckpt.wait()
  if run.ckpt.latest_step() != run.step:
    run.ckpt.save(run.step, run.state, force=True)
    run.ckpt.wait()
  if jax.process_index() == 0:
    preemption.save_pending(run.workdir, run.step, pending)
  run.writer.flush()
  logging.warning("stopped at step %d: checkpoint saved in %s", run.step, run.ckpt.directory)
  raise preemption.Preempted(run.step, guard.signum)


# ---------------------------------------------------------------------------------------------
# The loop's own chores.


def standard_chores(run: Run) -> list[chores_lib.Chore]:
  """Log, then the method's and the statistics' chores, eval, checkpoint, the end of the run."""
  config = run.config
  flops = flops_lib.planned(run.spec, upto=run.step)   # resumed runs continue the count
  masked = run.spec.sparse_shapes
  fpt = flops_lib.dense_flops_per_token(run.model_cfg, run.spec.kernel_shapes)
  peak = config.peak_flops or metrics_lib.device_peak_flops()
  lr_fn = jax.jit(schedules.learning_rate(config.optim, config.total_steps))
  unigram = batches.unigram_entropy(run.data.train)
  run.final["data/unigram_entropy"] = unigram
  if run.step == 0:
    # The initial state is a checkpoint too: a run that diverges early still leaves a finite
    # state to restart from (NonFiniteError never saves and never rotates a good one out).
    # Not again when it was restored from it (a stop before the first periodic checkpoint).
    if run.ckpt.latest_step() is None:
      run.ckpt.save(0, run.state, force=True)
    run.write(0, {"data/unigram_entropy": unigram, "model/params": model_lib.num_params(
        run.state.params), "model/sparse_weights": state_lib.num_sparse_weights(
            run.state.params, run.state.sparsity)})
  run.write(run.step, {"memory/state_bytes_per_device": sharding.bytes_per_device(
      (run.state.params, run.state.opt_state))})
  logging.info("%s: params %.2fM, unigram entropy %.3f nats, %d devices, resume at step %d",
               run.model_cfg.describe(), model_lib.num_params(run.state.params) / 1e6,
               unigram, jax.device_count(), run.step)
  val_batches = batches.eval_batches(run.data.val, batch_size=config.batch_size,
                                     seq_len=config.model.seq_len,
                                     num_batches=config.eval_batches)

  def count_flops(run):
    flops.add_step(run.model_cfg, run.info.step, masked)

  def log(run):
    pending, run.pending = jax.device_get(run.pending), []   # waits for the steps
    check_finite(run, pending)
    scalars = metrics_lib.summarise(pending, run.clock.lap(), fpt, peak,
                                    latest=methods_base.STATE_METRICS)
    scalars["train/lr"] = float(lr_fn(run.info.step))   # the lr of the step just taken
    scalars["train/dense_phase"] = float(run.method.sparse and not run.sparse_phase)
    scalars.update(flops.scalars())
    run.write(run.step, scalars)
    run.last_log = scalars
    run.postfix.update(loss=f"{scalars['train/loss']:.3f}",
                       tok_s=f"{scalars['perf/tokens_per_sec']:.0f}")
    if "train/flip_rate" in scalars:
      run.postfix["flip"] = f"{scalars['train/flip_rate']:.2e}"

  def evaluate_(run):
    loss = evaluate(run.state.params, run.state.sparsity, run.model, val_batches,
                    run.partitioner)
    run.write(run.step, {"val/loss": loss})
    run.postfix["val"] = f"{loss:.3f}"

  def checkpoint(run):
    check_finite(run, jax.device_get(run.pending))   # the steps since the last log
    run.ckpt.save(run.step, run.state, force=True)   # async write; the device->host copy blocks

  def finish(run):
    if run.writer.enabled:
      metrics_lib.plot(run.writer.jsonl_path, os.path.join(run.workdir, "metrics.png"),
                       title=run.base_cfg.describe())
    run.final.update(flops_lib.summary(flops))
    run.final["step"] = run.step

  Chore = chores_lib.Chore   # pylint: disable=invalid-name
  return [
      Chore(count_flops, every=1, before_step=True, training=True, name="FLOPs"),
      *diagnostics.chores(config),
      Chore(log, due=lambda info: info.log, training=True, name="log"),
      *run.method.chores(run.facts),
      Chore(evaluate_, every=config.eval_every, name="eval"),
      Chore(checkpoint, every=config.checkpoint_every, name="checkpoint"),
      Chore(finish, due=lambda info: info.next_step == run.total, name="plot and finals"),
  ]


def check_finite(run: Run, pending: list[dict]) -> None:
  """Stops the run (NonFiniteError) if a step among the `pending` ones (fetched metrics of
  the last len(pending) steps) had a non-finite loss or gradient norm: before anything is
  logged or saved, so no non-finite state is ever checkpointed and no good one is rotated
  out. Costs no extra device sync: it reads what the log or the checkpoint fetches anyway."""
  for i, m in enumerate(pending):
    if not m["finite"]:
      step = run.step - len(pending) + i + 1
      what = "loss" if not np.isfinite(m["loss"]) else "gradient norm"
      value = m["loss"] / m["count"] if what == "loss" else m["grad_norm"]
      run.ckpt.wait()
      good = run.ckpt.latest_step()
      where = (f"the last good checkpoint is step {good} in {run.ckpt.directory}"
               if good is not None else "there is no checkpoint yet")
      raise NonFiniteError(
          f"step {step}: the {what} is not finite ({value}); training stopped. Nothing "
          f"non-finite was saved; {where}. Lower optim.lr (or set optim.grad_clip) and "
          "resume from it, or start a new --workdir.")
