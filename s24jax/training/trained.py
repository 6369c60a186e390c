"""A finished run, read-only, and the weights its model computes with.

`load_run(workdir, step)` restores a workdir's checkpoint (the newest, or step N) without
writing, moving or creating anything in the workdir (Orbax's read-only manager), rebuilding the
run from its config.json; `Trained.model_cfg` is the model that step trained
(s24jax/training/model_schedule.py: dense fine-tuning, MST's attention window). `computed_params` replaces each
sparse layer's latent W by what the forward pass multiplies with, the method's project(W):
S(W) of a 2:4 method, beta S(W) of S-STE, the mask times W of MST; the dense W when the
step's model is dense. `dense_config` is the model that computes with those weights as plain
dense layers (the same function, without FP8 simulation). The evaluation
(s24jax/cli/evaluate.py) and the Hugging Face export (s24jax/cli/export.py) both start here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging as std_logging
import os
from typing import Any

import flax
import jax
import ml_collections
import orbax.checkpoint as ocp

from s24jax.training import config as config_lib
from s24jax import config_files
from s24jax import errors
from s24jax.nn import model as model_lib
from s24jax.training import model_schedule
from s24jax import state as state_lib
from s24jax.training import workdir as workdir_lib
from s24jax.methods import base as methods_base
from s24jax.methods import registry
from s24jax.training.run_spec import RunSpec

# What each built-in method's project(W) is (the fallback names the method's project hook).
PROJECTIONS = {
    "ste": "S(W) = m(W) * W, the 2:4 hard threshold (largest 2 of 4 magnitudes)",
    "sr_ste": "S(W) = m(W) * W, the 2:4 hard threshold",
    "t_sr_ste": "the cached transposable 2:4 mask times W",
    "s_ste": "beta * S(W), S-STE's 2:4 soft threshold times the frozen per-tensor scale",
    "mst": "the layer's current (unstructured) mask times W",
}


class RunError(errors.UserError):
  """A workdir, config or checkpoint that cannot be loaded (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Trained:
  """A run's checkpoint, restored read-only, and the model of its step."""
  workdir: str
  step: int
  spec: RunSpec
  model_cfg: model_lib.ModelConfig   # the model the step's last update trained (phases)
  params: Any
  sparsity: Any

  @property
  def tokenizer(self) -> str:
    return str(self.spec.config.data.get("tokenizer", "gpt2") or "gpt2")


def config_from_json(data: dict[str, Any]) -> ml_collections.ConfigDict:
  """The run config of a workdir's config.json: base_config() with every value applied, each
  type-checked as a command line sets it (config_files)."""
  config = config_lib.base_config()
  overrides = {}

  def walk(node, prefix=""):
    for k, v in node.items():
      key = f"{prefix}{k}"
      current = config_files.get_field(config, key)
      if isinstance(v, dict) and isinstance(current, ml_collections.ConfigDict):
        walk(v, key + ".")
      else:
        overrides[key] = v

  walk(data)
  config.lock()
  return config_files.apply_overrides(config, overrides)


def load_run(workdir: str, step: int | None = None) -> Trained:
  """The checkpoint of `step` (default: the newest) of `workdir`, restored read-only (nothing
  in the workdir is written, moved or created). RunError for a missing workdir, config or
  checkpoint, or one that does not fit the workdir's config."""
  workdir = os.path.abspath(workdir)
  if not os.path.isdir(workdir):
    raise RunError(f"{workdir}: no such workdir")
  data = workdir_lib.last_config(workdir)
  if data is None:
    raise RunError(f"{workdir}: no config.json, so not an s24jax run's workdir")
  try:
    config = config_from_json(data)
  except (ValueError, KeyError, TypeError) as e:
    raise RunError(f"{workdir}/config.json cannot be read as this s24jax's config: {e}") from e
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise RunError(f"{workdir}: no checkpoints folder; nothing to load")
  with _quiet_orbax():   # it warns that the directory is read-only: that is the point
    manager = ocp.CheckpointManager(
        directory, item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(read_only=True, create=False,
                                             enable_async_checkpointing=False))
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise RunError(f"{directory}: no checkpoint")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise RunError(f"{directory}: no checkpoint of step {step}; it has steps "
                        f"{', '.join(map(str, steps))}")
    spec = RunSpec.build(config)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                            spec.abstract_state)
    _check_shapes(manager, step, abstract, directory)
    try:
      state = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # pylint: disable=broad-except
      raise RunError(f"the checkpoint of step {step} in {directory} cannot be read "
                        f"({type(e).__name__}: {str(e)[:300]}); try an earlier --step "
                        f"({', '.join(map(str, steps))})") from e
  finally:
    manager.close()
  model_cfg = model_schedule.model_at(step - 1, spec.model_cfg, spec.facts) if step else spec.model_cfg
  return Trained(workdir, int(step), spec, model_cfg, state.params, state.sparsity)


@contextlib.contextmanager
def _quiet_orbax():
  logger = std_logging.getLogger("absl")
  level = logger.level
  logger.setLevel(std_logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _check_shapes(manager, step: int, abstract: Any, directory: str) -> None:
  try:
    meta = manager.item_metadata(step)
  except Exception:  # pylint: disable=broad-except
    return   # restore says what is wrong
  tree = getattr(meta, "tree", meta)
  if tree is None:
    return
  flat = lambda t: {k: tuple(v.shape) for k, v in flax.traverse_util.flatten_dict(
      _as_dict(t), sep="/").items() if hasattr(v, "shape")}
  want, have = flat(abstract), flat(tree)
  bad = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
  if bad:
    lines = [f"  {k}: checkpoint {have.get(k)} vs config {want.get(k)}" for k in bad[:8]]
    raise RunError(f"the checkpoint of step {step} in {directory} does not match the "
                      "workdir's config.json:\n" + "\n".join(lines))


def _as_dict(tree: Any) -> Any:
  if hasattr(tree, "shape") and hasattr(tree, "dtype"):
    return tree
  if hasattr(tree, "__dataclass_fields__"):
    return {k: _as_dict(getattr(tree, k)) for k in tree.__dataclass_fields__}
  if isinstance(tree, dict):
    return {str(k): _as_dict(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):   # named tuples (optax states) by their fields
    keys = getattr(tree, "_fields", None) or range(len(tree))
    return {str(k): _as_dict(v) for k, v in zip(keys, tree)}
  return tree


# ---------------------------------------------------------------------------------------------
# The weights the model computes with.


def computed_params(model_cfg: model_lib.ModelConfig, params: Any, sparsity: Any) -> Any:
  """params with each sparse layer's weight replaced by what the forward pass multiplies
  with, the method's project(W, layer) (the tied embedding too when it is sparse); the
  params as they are when the step's model is dense (a dense run, dense fine-tuning)."""
  params = flax.core.unfreeze(jax.tree.map(lambda x: x, params))
  method = model_cfg.sparsity.method
  if not method.sparse:
    return params
  for path in state_lib.sparse_layer_paths(sparsity):
    layer = state_lib.get_path(params, path)
    name = state_lib.weight_name(layer)
    layer[name] = methods_base.per_layer(method.project)(
        layer[name], methods_base.layer_at(sparsity, path))
  return params


def dense_config(model_cfg: model_lib.ModelConfig, dtype: str = "float32"
                 ) -> model_lib.ModelConfig:
  """The model that computes with `computed_params` as plain dense layers: no projection,
  no FP8 GEMM simulation, the 'xla' GEMMs, the compute `dtype`; V:N:M activation sparsity and
  the attention pattern are kept (they are the model's)."""
  sp = dataclasses.replace(model_cfg.sparsity, method=registry.get_method("dense"), fp8=False,
                           mvue=False, backend="xla")
  return dataclasses.replace(model_cfg, sparsity=sp, dtype=dtype, remat="none", loss_chunk=0)


def weights_statement(trained: Trained) -> str:
  """Which weights `computed_params` gives, in words."""
  run_method, method = trained.spec.method, trained.model_cfg.sparsity.method
  if method.sparse:
    layers = [state_lib.layer_name(p) for p in state_lib.sparse_layer_paths(trained.sparsity)]
    what = PROJECTIONS.get(method.name, f"{method.name}'s project(W)")
    text = (f"W~ = {what}, in the sparse layers ({', '.join(layers)}); the dense W elsewhere")
    if trained.model_cfg.sparsity.fp8:
      text += ("; training simulated FP8 GEMMs in those layers, here they are float32 GEMMs "
               "with the same W~")
    return text
  if run_method.sparse:
    start = model_schedule.dense_finetune_start(trained.spec.facts)
    return (f"the dense W of dense fine-tuning (steps >= {start} of {run_method.name}; "
            "no mask)")
  return "the dense W (no sparse layer)"
