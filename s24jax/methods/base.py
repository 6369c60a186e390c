"""The method interface: what a sparse-training method is, in a few hooks, and its registry.

A method is a frozen dataclass. Its fields are its hyper-parameters, which are also its config
block, `config.sparsity.<name>` (so `--config.sparsity.s_ste.rescale_every=1` works for any
registered method). `config.sparsity.method` names the method that trains the sparse layers.
The train step, the loop and the optimizer call only the hooks below; none of them knows which
method runs (docs/algorithms.md describes every built-in one).

Hooks, in the order a training step meets them:

  init_layer(kernel) -> dict              per sparse layer, at init: the layer's sparsity state
                                          (at least 'mask', the mask of the last step), kept in
                                          the train state's 'sparsity' collection (checkpointed)
  project(kernel, layer) -> w_tilde       the weight the forward pass uses: a jax.custom_vjp
                                          projection whose backward rule is the method
  mask(kernel, layer) -> bool             the 2:4 support of project(kernel, layer) right now
  init_state() -> dict                    method-wide state (e.g. a controller), stored in the
                                          'sparsity' collection under the method's name
  init_train(params, sparsity, rng) -> (params, sparsity)
                                          the fresh state's start, after model.init (e.g. MST:
                                          a random sparse mask, weights outside it zeroed)
  gradients(grads, sparsity) -> grads     before the optimizer (e.g. MST: active entries only)
  optimizer_transforms(placement, is_sparse) -> [optax transforms]
                                          inserted at 'gradients' (after clipping, before Adam)
                                          or 'weights' (after AdamW's decay, before the lr)
  optimizer_args(params, sparsity) -> dict
                                          extra arguments for those transforms, per step
  after_update(params, sparsity, step) -> (params, sparsity, metrics)
                                          inside the jitted step after the optimizer: mask
                                          refresh, flip rate, rescaling, controllers
  finish_step(state, new_state, grads, metrics) -> (new_state, metrics)
                                          the step's last word: may replace the update it just
                                          made (on device, e.g. lax.cond on a flag in the
                                          state), given the raw gradients of the step's loss
                                          (before `gradients`, unclipped). MST: on its topology
                                          steps, new masks from those gradients instead of the
                                          optimizer step
  model_at(step, model_cfg, config) -> ModelConfig
                                          the model a step trains (phases: dense fine-tuning,
                                          attention windows); one compiled step per distinct one
  enter(state, new_cfg) -> state          when the loop switches away from this method's model
  hooks(config) -> [hooks.Hook]           host-side chores between steps (MST topology updates,
                                          the flip-rate warning, logging a chosen lambda)
  flop_profile(step, shapes, config) -> (active counts | None, dense weight gradient?)
                                          for the FLOP accounting (s24jax/flops.py)

The base class is the plain hard-threshold 2:4 method minus its projection: `mask` is the
2:4 mask of |W|, `after_update` measures the flip rate against the stored mask and stores the
new one. A stateless method only writes `project`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax
import jax
import jax.numpy as jnp

from s24jax import flip_monitor
from s24jax import hooks as hooks_lib
from s24jax.kernels import masks
from s24jax import state as state_lib

Layer = dict[str, jax.Array]
# A dataclass field that is not a hyper-parameter (not part of the config block).
INTERNAL = {"config": False}


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

  # -- configuration --------------------------------------------------------------------------

  def configure(self, config) -> "Method":
    """Cross-checks against the whole run config and resolves run-dependent defaults."""
    del config
    return self

  # -- what the model sees --------------------------------------------------------------------

  def init_layer(self, kernel: jax.Array) -> Layer:
    return {"mask": self.mask(kernel, {})}

  def project(self, kernel: jax.Array, layer: Layer) -> jax.Array:
    raise NotImplementedError(f"method {self.name!r} has no projection")

  def mask(self, kernel: jax.Array, layer: Layer) -> jax.Array:
    del layer
    return masks.nm_mask(kernel)

  def init_state(self) -> dict[str, jax.Array]:
    return {}

  def init_train(self, params: Any, sparsity: Any, rng: jax.Array) -> tuple[Any, Any]:
    """The fresh train state's params and sparsity collection, after model.init (inside the
    jitted init; `rng` is the method's own key). The default keeps them."""
    del rng
    return params, sparsity

  # -- the train step -------------------------------------------------------------------------

  def gradients(self, grads: Any, sparsity: Any) -> Any:
    del sparsity
    return grads

  def optimizer_transforms(self, placement: str, is_sparse: Any) -> list:
    del placement, is_sparse
    return []

  def optimizer_args(self, params: Any, sparsity: Any) -> dict[str, Any]:
    del params, sparsity
    return {}

  def after_update(self, params: Any, sparsity: Any, step: jax.Array
                   ) -> tuple[Any, Any, dict[str, jax.Array]]:
    """Stores each layer's new mask; metrics: the flip rate against the stored one and the
    scalar layer state. `step` is the optimizer step just taken (0-based)."""
    sparsity, metrics = self.update_masks(params, sparsity, step)
    sparsity = self.update_layers(params, sparsity, step + 1)
    metrics.update(layer_scalars(sparsity))
    return params, sparsity, metrics

  def update_masks(self, params: Any, sparsity: Any, step: jax.Array
                   ) -> tuple[Any, dict[str, jax.Array]]:
    """Stores the masks the next forward passes use and returns the flip-rate metrics
    against the stored ones: here mask(W) of the updated weights, every step."""
    del step
    paths = state_lib.sparse_layer_paths(sparsity)
    new = {p: self.mask(kernel_at(params, p), layer_at(sparsity, p)) for p in paths}
    return state_lib.with_masks(sparsity, new), flip_rates(new, sparsity)

  def update_layers(self, params: Any, sparsity: Any, steps_done: jax.Array) -> Any:
    """Per-layer state after `steps_done` optimizer steps (S-STE's rescale); masks aside."""
    del params, steps_done
    return sparsity

  def finish_step(self, state: Any, new_state: Any, grads: Any, metrics: dict[str, jax.Array]
                  ) -> tuple[Any, dict[str, jax.Array]]:
    """The train step's last hook, inside the jitted step: `state` is the state before the
    step, `new_state` after the optimizer and `after_update`, `grads` the raw gradients of
    the step's mean loss (before `gradients` and clipping). Returns the step's state and
    metrics; a method may replace the update on some steps (decided on device, so the step
    compiles once). The default returns them unchanged."""
    del state, grads
    return new_state, metrics

  # -- the loop -------------------------------------------------------------------------------

  def model_at(self, step: int, model_cfg, config):
    """The model of `step`: this one, and its dense twin during dense fine-tuning (the last
    `sparsity.dense_finetune_fraction` of the steps)."""
    if step >= dense_finetune_start(config):
      return model_cfg.dense_twin()
    return model_cfg

  def enter(self, state, new_cfg):
    """Leaving this method's model for `new_cfg`'s. Entering dense fine-tuning continues from
    the latent W (`sparsity.dense_finetune_init='latent'`, the reference's way: pruned
    weights come back) or replaces each sparse latent W by the weight the forward pass used,
    W~ ('projected': the loss is continuous at the switch)."""
    if (new_cfg.sparsity.method.sparse or not self.sparse
        or new_cfg.sparsity.dense_finetune_init == "latent"):
      return state
    params = flax.core.unfreeze(jax.tree.map(lambda x: x, state.params))
    for path in state_lib.sparse_layer_paths(state.sparsity):
      layer = state_lib.get_path(params, path)
      name = state_lib.weight_name(layer)
      layer[name] = per_layer(self.project)(layer[name], layer_at(state.sparsity, path))
    return state.replace(params=params)

  def hooks(self, config) -> list:
    """Host-side chores (s24jax/hooks.py). The base warns when the flip rate stays above
    `sparsity.flip_rate_warn` for `flip_rate_warn_patience` logs (s24jax/flip_monitor.py)."""
    if not self.sparse or not config.sparsity.flip_rate_warn:
      return []
    monitor = flip_monitor.FlipRateMonitor(config.sparsity.flip_rate_warn,
                                           config.sparsity.flip_rate_warn_patience)

    def warn(run):
      if run.model_cfg.sparsity.method.sparse:   # no mask during dense fine-tuning
        flag = monitor.update(run.step, run.last_log.get("train/flip_rate"))
        run.write(run.step, {"train/flip_rate_warning": flag})

    return [hooks_lib.Hook(warn, every=config.log_every, name="flip-rate warning")]

  def flop_profile(self, step: int, shapes: dict[str, tuple[int, int]], config
                   ) -> tuple[dict[str, int] | None, bool]:
    """(active weights per layer name, or None if unchanged since the last step; whether the
    step computes the dense weight gradient of its sparse layers, as MST's topology updates
    do). `shapes` are the sparse layers' (out, in), the tied head's 'wte' (vocab, C)
    included when it is sparse. The base counts the layers dense: the xla backend
    multiplies 2:4 weights densely."""
    del step, shapes, config
    return {}, False

  # -- config blocks --------------------------------------------------------------------------

  def config_block(self) -> dict[str, Any]:
    """The hyper-parameters (dataclass fields that are config), with their current values."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.metadata.get("config", True)}


# ---------------------------------------------------------------------------------------------
# Helpers the methods share.


def kernel_at(params: Any, path: tuple[str, ...]) -> jax.Array:
  """The sparse layer's weight: its kernel, or the tied embedding table (vocab, C)."""
  layer = state_lib.get_path(params, path)
  return layer[state_lib.weight_name(layer)]


def layer_at(sparsity: Any, path: tuple[str, ...]) -> Layer:
  return dict(state_lib.get_path(sparsity, path))


def flip_rates(new: dict[tuple[str, ...], jax.Array], sparsity: Any, *, entry: str = "mask",
               name: str = "flip_rate") -> dict[str, jax.Array]:
  """Per-layer flip rate (masks.flip_rate of the new mask against the stored `entry`) and the
  global rate over all sparse layers (size-weighted): '<name>/<layer>', '<name>'."""
  out, changed, total = {}, 0.0, 0
  for path, m in new.items():
    rate = masks.flip_rate(m, layer_at(sparsity, path)[entry])
    out[f"{name}/{state_lib.layer_name(path)}"] = rate
    changed, total = changed + rate * m.size, total + m.size
  if total:
    out[name] = changed / total
  return out


def per_layer(fn):
  """fn(kernel (out, in), *per-layer args) applied layer by layer to the stacked kernels of
  scanned blocks ((L, out, in), model.scan_layers; the args stacked along their first axis)."""
  def apply(kernel, *args):
    if kernel.ndim <= 2:
      return fn(kernel, *args)
    return jax.vmap(per_layer(fn))(kernel, *args)
  return apply


def layer_scalars(sparsity: Any) -> dict[str, jax.Array]:
  """Scalar layer state (e.g. the S-STE scale) per layer, 'sparsity/<name>/<layer>', and its
  mean over layers, 'sparsity/<name>' (so a growing recomputed scale is visible)."""
  out, per_name = {}, {}
  for path in state_lib.sparse_layer_paths(sparsity):
    for name, value in state_lib.get_path(sparsity, path).items():
      if name != "mask" and getattr(value, "ndim", None) in (0, 1):
        value = jnp.mean(value) if value.ndim else value   # scanned blocks: mean over layers
        out[f"sparsity/{name}/{state_lib.layer_name(path)}"] = value
        per_name.setdefault(name, []).append(value.astype(jnp.float32))
  for name, values in per_name.items():
    out[f"sparsity/{name}"] = jnp.mean(jnp.stack(values))
  return out


def dense_finetune_start(config) -> int:
  """First step of dense fine-tuning (total_steps when there is none). Hu et al. 2024 train
  sparse for 5/6 of the steps (fraction 1/6); the PyTorch/xformers practice is 0.3."""
  total = int(config.total_steps)
  return total - int(round(float(config.sparsity.dense_finetune_fraction) * total))


# ---------------------------------------------------------------------------------------------
# The registry: name -> a method with its default hyper-parameters.

_REGISTRY: dict[str, Method] = {}


def register_method(name: str, method: Method, *, overwrite: bool = False) -> Method:
  """Registers `method` (an instance: its field values are the defaults of its config block)
  so that `config.sparsity.method = name` trains with it. Re-registering a name needs
  overwrite=True, so a typo in a notebook cannot silently replace a built-in."""
  if not isinstance(method, Method):
    raise TypeError(f"register_method needs a Method instance, got {method!r} (a plain "
                    "projection function goes through projections.register_projection)")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"method {name!r} is already registered; pass overwrite=True to "
                     "replace it.")
  method = dataclasses.replace(method, name=name)
  hash(method)   # the model closes over it: it must be hashable (a jit static argument)
  _REGISTRY[name] = method
  return method


def available_methods() -> tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def get_method(name: str) -> Method:
  """The registered method `name` with its default hyper-parameters."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"unknown method (sparsity.method) {name!r}; valid: "
                     f"{', '.join(available_methods())}") from None


def config_blocks() -> dict[str, dict[str, Any]]:
  """{method name: its config block} for every registered method (base_config uses it)."""
  return {name: m.config_block() for name, m in sorted(_REGISTRY.items())}


def from_config(config) -> Method:
  """The method `config.sparsity.method` with the hyper-parameters of its block,
  validated and configured for this run."""
  check_renamed_keys(config)
  method = get_method(config.sparsity.method)
  block = dict(config.sparsity.get(method.name, None) or {})
  valid = set(method.config_block())
  unknown = sorted(set(block) - valid)
  if unknown:
    raise ValueError(f"unknown fields {unknown} in config.sparsity.{method.name}; valid: "
                     f"{sorted(valid)}")
  block = {k: tuple(v) if isinstance(v, list) else v for k, v in block.items()}
  return dataclasses.replace(method, **block).configure(config)


def check_renamed_keys(config) -> None:
  """A config (an old experiment file, or a resumed workdir's config.json) that still uses
  the key renamed in 0.3 gets an error naming the new one, not a silent default."""
  if "projection" in config.sparsity:
    raise ValueError("config.sparsity.projection was renamed to config.sparsity.method (it "
                     "selects the training method); set --config.sparsity.method="
                     f"{config.sparsity.projection!r} instead")


def check_positive_int(name: str, value: int, minimum: int = 1) -> None:
  if int(value) != value or value < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

