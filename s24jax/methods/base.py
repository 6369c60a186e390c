"""The method interface: what a sparse-training method is, in a few hooks.

A method is a frozen dataclass. Its fields are its hyper-parameters, which are also its config
block, `config.sparsity.<name>` (so `--config.sparsity.s_ste.rescale_every=1` works for any
registered method); `config.sparsity.method` names the method that trains the sparse layers
(s24jax/methods/registry.py). The model, the train step and the loop call only the hooks
below; none of them knows which method runs (docs/algorithms.md describes every built-in one).

The core, in the order a run meets it (a method that only projects overrides `project`):

  configure(facts: RunFacts) -> Method    once, before the model: cross-checks against the run
                                          (frozen facts, not the mutable config) and resolves
                                          run-dependent defaults
  init_layer(kernel) -> Layer             per sparse layer, at init: the layer's state, in the
                                          train state's 'sparsity' collection. It must hold
                                          'mask' (bool, the kernel's shape: the support of the
                                          last step): that key is what makes a layer sparse to
                                          the refresh, the FLOP count, the optimizer and the
                                          phases, so a layer state without it is refused
                                          (`check_layer`)
  project(kernel, layer) -> W~            the weight the forward pass uses: a jax.custom_vjp
                                          projection whose backward rule is the method
  mask(kernel, layer) -> bool             the 2:4 support of project(kernel, layer) now
  init_state(params, sparsity, rng) -> (params, sparsity, method_state)
                                          the fresh state's start, after model.init; the
                                          method-wide state (a controller, a plan) is a pytree
                                          of its own in `TrainState.method_state`
  update(before, after, grads, info) -> (TrainState, metrics)
                                          per-step device work, inside the jitted step, after
                                          the optimizer: mask refresh and flip rate (the
                                          default), rescaling, controllers, MST's topology
                                          update (which may replace the step's update).
                                          `info` is the loop's `StepInfo` of the step (its
                                          index, steps done, whether it is logged): a method
                                          reads the schedule from it, never re-derives it
  chores(facts: RunFacts) -> [chores.Chore]
                                          host-side chores between steps (the flip-rate
                                          warning, logging a chosen lambda_W, plots); each
                                          sees a typed `chores.Context`

Optional capabilities, separate classes a method also inherits when it needs them (the
optimizer, the loop's phases and the FLOP accounting look for them with isinstance):

  OptimizerTransforms.optimizer_transforms(placement, is_sparse) -> [optax transforms]
      SR-STE's masked decay; MST's gradient mask
  ModelPhases.model_at(step, model_cfg) -> ModelConfig
      a model that changes with the step (MST's sparse-attention window); dense fine-tuning
      is not a method's business (s24jax/training/model_schedule.py)
  DynamicDensity.active_weights(step, shapes) -> (counts | None, dense weight gradient?)
      weights that change in number (MST), for s24jax/training/flops.py

The default `update` is the plain hard-threshold 2:4 bookkeeping: `refresh` stores mask(W) of
the updated weights and measures the flip rate against the stored mask.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp

from s24jax import chores as chores_lib
from s24jax.methods import flip_monitor
from s24jax import state as state_lib
from s24jax.kernels import masks
from s24jax.step_info import StepInfo

Layer = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
# A dataclass field that is not a hyper-parameter (not part of the config block).
INTERNAL = {"config": False}


@dataclasses.dataclass(frozen=True)
class RunFacts:
  """What a method (and the phases) may know of the run: frozen, built once from the config."""
  total_steps: int
  warmup_steps: int
  log_every: int
  backend: str                          # sparsity.backend
  sparse_layers: tuple[str, ...]        # sparsity.sparse_layers
  scan_layers: bool                     # model.scan_layers
  attention: str                        # model.attention (outside any method's window)
  attention_stride: int                 # model.attention_stride
  dense_finetune_fraction: float        # sparsity.dense_finetune_fraction
  flip_rate_warn: float                 # sparsity.flip_rate_warn (0: off)
  flip_rate_warn_patience: int
  head: str = state_lib.HEAD            # the LM head's layer name (model.family's)

  @classmethod
  def from_config(cls, config) -> "RunFacts":
    sp, m = config.sparsity, config.model
    return cls(total_steps=int(config.total_steps),
               warmup_steps=int(config.optim.warmup_steps),
               log_every=int(config.log_every), backend=str(sp.backend),
               sparse_layers=tuple(sp.sparse_layers),
               scan_layers=bool(m.get("scan_layers", False)),
               attention=str(m.attention), attention_stride=int(m.attention_stride),
               dense_finetune_fraction=float(sp.dense_finetune_fraction),
               flip_rate_warn=float(sp.flip_rate_warn),
               flip_rate_warn_patience=int(sp.flip_rate_warn_patience),
               head=state_lib.HEADS.get(str(m.get("family", "gpt2")), state_lib.HEAD))


@dataclasses.dataclass(frozen=True)
class Method:
  """A sparse-training method (see the module docstring). Subclasses add fields (their config
  block) and override hooks; `__post_init__` validates the fields, `configure` the rest."""
  name: str = dataclasses.field(default="", metadata=INTERNAL)
  # False: no layer is sparse under this method (dense training, the dense fine-tuning twin).
  sparse: ClassVar[bool] = True
  # Whether the method's linear layers are 2:4 along `in` (the fast GEMM backends need it).
  structured_24: ClassVar[bool] = True
  # Whether its masks are transposable (W~ 2:4 along `out` too): sparse data-gradient GEMMs.
  transposable: ClassVar[bool] = False

  def configure(self, facts: RunFacts) -> "Method":
    del facts
    return self

  # -- what the model sees --------------------------------------------------------------------

  def init_layer(self, kernel: jax.Array) -> Layer:
    return {"mask": self.mask(kernel, {})}

  def project(self, kernel: jax.Array, layer: Layer) -> jax.Array:
    raise NotImplementedError(f"method {self.name!r} has no projection")

  def mask(self, kernel: jax.Array, layer: Layer) -> jax.Array:
    del layer
    return masks.nm_mask(kernel)

  # -- the train state and the step -----------------------------------------------------------

  def init_state(self, params: Any, sparsity: Any, rng: jax.Array) -> tuple[Any, Any, Any]:
    """The fresh state's params, sparsity collection and method state, after model.init
    (inside the jitted init; `rng` is the method's own key). The default: no method state."""
    del rng
    return params, sparsity, {}

  def update(self, before: state_lib.TrainState, after: state_lib.TrainState, grads: Any,
             info: StepInfo) -> tuple[state_lib.TrainState, Metrics]:
    """The step's device work after the optimizer. `before` is the state the step started
    from, `after` the state with the optimizer's update applied (step + 1), `grads` the raw
    gradients of the step's mean loss (unclipped), `info` the loop's StepInfo of this step.
    Returns the step's final state and the method's metrics. The default refreshes the
    masks (`refresh`)."""
    del grads
    if not self.sparse:
      return after, {}
    sparsity, metrics = self.refresh(after.params, after.sparsity, info)
    return after.replace(sparsity=sparsity), metrics

  def refresh(self, params: Any, sparsity: Any, info: StepInfo) -> tuple[Any, Metrics]:
    """Stores the masks the next forward passes use and returns the flip-rate metrics
    against the stored ones: here mask(W) of the updated weights, every step. `info` is the
    step just taken."""
    del info
    paths = state_lib.sparse_layer_paths(sparsity)
    new = {p: self.mask(kernel_at(params, p), layer_at(sparsity, p)) for p in paths}
    return state_lib.with_masks(sparsity, new), flip_rates(new, sparsity)

  # -- the loop -------------------------------------------------------------------------------

  def chores(self, facts: RunFacts) -> list[chores_lib.Chore]:
    """Host-side chores. The base warns when the flip rate stays above
    `sparsity.flip_rate_warn` for `flip_rate_warn_patience` logs (s24jax/methods/flip_monitor.py),
    right after each log."""
    if not self.sparse or not facts.flip_rate_warn:
      return []
    monitor = flip_monitor.FlipRateMonitor(facts.flip_rate_warn, facts.flip_rate_warn_patience)

    def warn(ctx: chores_lib.Context) -> None:
      if ctx.sparse_phase:   # no mask during dense fine-tuning
        step = ctx.info.next_step
        flag = monitor.update(step, ctx.last_log.get("train/flip_rate"))
        ctx.write(step, {"train/flip_rate_warning": flag})

    return [chores_lib.Chore(warn, due=lambda info: info.log, name="flip-rate warning")]

  def config_block(self) -> dict[str, Any]:
    """The hyper-parameters (dataclass fields that are config), with their current values."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.metadata.get("config", True)}


# ---------------------------------------------------------------------------------------------
# Optional capabilities.


class OptimizerTransforms:
  """A method that adds optax transforms to the optimizer (s24jax/training/optim.py):

      clip <- 'raw' | -> 'gradients' -> Adam -> weight decay -> 'weights' -> lr

  Each transform's `update` receives the step's extra arguments `method` (the method of the
  step's model: the dense twin during dense fine-tuning), `sparsity` (the collection) and
  `method_state`."""

  def optimizer_transforms(self, placement: str, is_sparse: Any) -> list:
    raise NotImplementedError


class ModelPhases:
  """A method whose model changes with the step (one compiled step per distinct model)."""

  def model_at(self, step: int, model_cfg):
    raise NotImplementedError


class DynamicDensity:
  """A method whose number of active weights changes during the run (s24jax/training/flops.py)."""

  def active_weights(self, step: int, shapes: Mapping[str, tuple[int, int]]
                     ) -> tuple[dict[str, int] | None, bool]:
    """(active weights per layer name, or None if unchanged since the last step; whether the
    step computes the dense weight gradient of its sparse layers). `shapes` are the sparse
    layers' (out, in), the tied head's 'wte' (vocab, C) included when it is sparse."""
    raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# Helpers the methods share.


def kernel_at(params: Any, path: tuple[str, ...]) -> jax.Array:
  """The sparse layer's weight: its kernel, or the tied embedding table (vocab, C)."""
  layer = state_lib.get_path(params, path)
  return layer[state_lib.weight_name(layer)]


def layer_at(sparsity: Any, path: tuple[str, ...]) -> Layer:
  return dict(state_lib.get_path(sparsity, path))


def flip_rates(new: dict[tuple[str, ...], jax.Array], sparsity: Any, *, entry: str = "mask",
               name: str = "flip_rate") -> Metrics:
  """Per-layer flip rate (masks.flip_rate of the new mask against the stored `entry`) and the
  global rate over all sparse layers (size-weighted): '<name>/<layer>', '<name>'."""
  return flip_rates_between(new, {p: layer_at(sparsity, p)[entry] for p in new}, name=name)


def flip_rates_between(new: dict[tuple[str, ...], jax.Array],
                       old: dict[tuple[str, ...], jax.Array], *, name: str = "flip_rate"
                       ) -> Metrics:
  """`flip_rates` of the masks `new` against `old` (same layer paths)."""
  out, changed, total = {}, 0.0, 0
  for path, m in new.items():
    rate = masks.flip_rate(m, old[path])
    out[f"{name}/{state_lib.layer_name(path)}"] = rate
    changed, total = changed + rate * m.size, total + m.size
  if total:   # a float: a 7B model's mask count (4.3e9) overflows the int32 a jit takes it as
    out[name] = changed / float(total)
  return out


def per_layer(fn):
  """fn(kernel (out, in), *per-layer args) applied layer by layer to the stacked kernels of
  scanned blocks ((L, out, in), model.scan_layers; the args stacked along their first axis)."""
  def apply(kernel, *args):
    if kernel.ndim <= 2:
      return fn(kernel, *args)
    return jax.vmap(per_layer(fn))(kernel, *args)
  return apply


def check_layer(method: Method, layer: Layer, kernel: jax.Array) -> Layer:
  """`layer` (what method.init_layer returned), refused unless it holds the 'mask' the
  train step, the FLOP count, the optimizer and the phases recognise a sparse layer by."""
  mask = layer.get("mask") if isinstance(layer, Mapping) else None
  if mask is None:
    raise ValueError(f"method {method.name!r}: init_layer returned "
                     f"{sorted(layer) if isinstance(layer, Mapping) else layer!r}, without "
                     "the 'mask' entry every sparse layer state needs (bool, the kernel's "
                     "shape; base.Method.init_layer makes it: return {..., "
                     "**super().init_layer(kernel)})")
  if tuple(mask.shape) != tuple(kernel.shape) or mask.dtype != jnp.bool_:
    raise ValueError(f"method {method.name!r}: init_layer's 'mask' is {mask.dtype}"
                     f"{tuple(mask.shape)}; it must be bool with the kernel's shape "
                     f"{tuple(kernel.shape)}")
  return layer


# The metric prefix of method state the train step reports as it leaves the step (per-layer
# scalars such as the S-STE scale, SR-STE's lambda_W): the log keeps the latest value.
STATE_METRICS = "method/"


def layer_scalars(sparsity: Any) -> Metrics:
  """Scalar layer state (e.g. the S-STE scale) per layer, 'method/<name>/<layer>', and its
  mean over layers, 'method/<name>' (so a growing recomputed scale is visible)."""
  out, per_name = {}, {}
  for path in state_lib.sparse_layer_paths(sparsity):
    for name, value in state_lib.get_path(sparsity, path).items():
      if name != "mask" and getattr(value, "ndim", None) in (0, 1):
        value = jnp.mean(value) if value.ndim else value   # scanned blocks: mean over layers
        out[f"{STATE_METRICS}{name}/{state_lib.layer_name(path)}"] = value
        per_name.setdefault(name, []).append(value.astype(jnp.float32))
  for name, values in per_name.items():
    out[f"{STATE_METRICS}{name}"] = jnp.mean(jnp.stack(values))
  return out


def check_positive_int(name: str, value: int, minimum: int = 1) -> None:
  if int(value) != value or value < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
