"""A new run started from a Hugging Face `transformers` directory: `--config.init_from`, the
way back of `python -m s24jax.cli.export` (s24jax/cli/export.py writes such directories;
s24jax/nn/hf_layouts.py: each family as transformers' classes see it).

`--config.init_from=/path/to/hf_dir` starts a new run from such a directory
(`init_from_hf`; its config and tokenizer must be the run's, else `ExportError`), rebuilding
what init derives from the weights (sparse layers' masks, S-STE's scale, the method's and the
optimizer's state). Import then export is the identity on the weights of a dense run of the
directory's vocabulary; a larger (padded) run vocabulary gets the mean row, so a padded id's
logit is the mean logit and, by Jensen, adds at most 1/V to the softmax's normaliser (GPT-2's
47 padded rows move log-probabilities by at most 47/50257 < 0.001 nats).
"""
from __future__ import annotations

import functools
import os
import pathlib
from typing import Any

import flax
import jax
import numpy as np
from absl import logging
from safetensors import numpy as safetensors_np

from s24jax import state as state_lib
from s24jax.data import hf_tokenizer
from s24jax.methods import base as methods_base
from s24jax.nn import hf_layouts
from s24jax.nn import model as model_lib
from s24jax.training import checkpoint as ckpt_lib
from s24jax.training.run_spec import RunSpec

WEIGHTS = "model.safetensors"   # the weights' file, as transformers' save_pretrained names it
ExportError = hf_layouts.ExportError


def read_hf_dir(path: str | os.PathLike[str], model_cfg: model_lib.ModelConfig,
                tokenizer: str) -> dict[str, np.ndarray]:
  """The Hugging Face state dict of a local directory, after checking its config.json against the
  run's model and its tokenizer against the run's (ExportError otherwise)."""
  path = pathlib.Path(path).expanduser()
  layout = hf_layouts.layout(model_cfg)
  arch = layout.architecture(model_cfg)
  where = f"config.init_from={path}"   # every message names the field the user set
  expected = (f"expected a local {arch} directory (transformers' save_pretrained, or python -m "
              "s24jax.cli.export)")
  if not path.is_dir():
    what = ("does not exist" if not os.path.lexists(path) else
            f"is a symbolic link to {os.readlink(path)}, which does not exist"
            if path.is_symlink() and not path.exists() else "is a file, not a folder")
    raise ExportError(f"{where} {what}: {expected}")
  if (path / ckpt_lib.CHECKPOINTS).is_dir() or (path / "metrics.jsonl").is_file():
    raise ExportError(f"{where} is an s24jax run's workdir, not a Hugging Face "
                      "directory: export it first: python -m s24jax.cli.export --workdir "
                      f"{path} --out {path / 'hf'}, then --config.init_from={path / 'hf'}")
  if not (path / "config.json").is_file():
    raise ExportError(f"{where}: no config.json there; {expected}")
  cfg = hf_tokenizer.read_json(path / "config.json")
  if not isinstance(cfg, dict):
    raise ExportError(f"{where}: its config.json holds a JSON {type(cfg).__name__}, not the "
                      f"object of a model's config; {expected}")
  wrong = layout.config_problems(cfg, model_cfg)
  if wrong:
    raise ExportError(f"{where}: its config.json does not describe the run's model ({arch}): "
                      f"{'; '.join(wrong)}")
  try:
    hf_tokenizer.check(path, tokenizer)
  except hf_tokenizer.TokenizerFilesError as e:
    raise ExportError(f"{where}: {e}; the run refuses to start from it") from e
  eps = cfg.get("layer_norm_epsilon", 1e-5)
  if layout is hf_layouts.GPT2 and eps != hf_layouts.LAYER_NORM_EPS:
    logging.warning("%s: layer_norm_epsilon %g; s24jax's LayerNorm uses %g (a small change of "
                    "the function)", path, eps, hf_layouts.LAYER_NORM_EPS)
  index = path / "model.safetensors.index.json"
  if (path / WEIGHTS).is_file():
    files = [path / WEIGHTS]
  elif index.is_file():
    weight_map = hf_tokenizer.read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str)
                                                   for f in weight_map.values()):
      raise ExportError(f"{where}: {index.name} has no weight_map of tensor names to files "
                        "(as save_pretrained writes it)")
    files = sorted({path / f for f in weight_map.values()})
  else:
    raise ExportError(f"{where}: no {WEIGHTS} (or sharded model.safetensors.index.json); "
                      "s24jax reads safetensors only (save_pretrained writes it)")
  state = {}
  for f in files:
    try:
      state.update(safetensors_np.load_file(str(f)))
    except Exception as e:  # pylint: disable=broad-except
      raise ExportError(f"{where}: {f} cannot be read as safetensors ({e})") from None
  head = state.get("lm_head.weight")
  wte = state.get("transformer.wte.weight", state.get("wte.weight"))
  if (layout is hf_layouts.GPT2 and head is not None and wte is not None
      and not np.array_equal(head, wte)):
    raise ExportError(f"{where}: lm_head.weight differs from the token embedding; s24jax "
                      "ties them")
  return state


def load_hf_params(model_cfg: model_lib.ModelConfig, params: Any, path: str,
                   tokenizer: str = "gpt2") -> Any:
  """The weights of the Hugging Face directory at `path` as params shaped like `params` (a fresh state's, or their
  ShapeDtypeStructs), after the checks of read_hf_dir."""
  state = read_hf_dir(path, model_cfg, tokenizer)
  return hf_layouts.layout(model_cfg).from_hf(model_cfg, state, params,
                                              f"config.init_from={path}")


def check_init_from(spec: RunSpec) -> None:
  """ExportError unless the run's config.init_from (if set) is a directory the run can start
  from: its config, tokenizer and tensors (for validation, before anything is written)."""
  if spec.config.get("init_from"):
    load_hf_params(spec.model_cfg, spec.abstract_state.params, spec.config.init_from,
                   _tokenizer(spec))


def _tokenizer(spec: RunSpec) -> str:
  return str(spec.config.data.get("tokenizer", "gpt2") or "gpt2")


def _with_params(spec: RunSpec, state: state_lib.TrainState, params: Any):
  """The fresh state rebuilt around `params`: each sparse layer's state (init_layer, as
  model.init does), the method's (init_state, with fresh_state's key), the optimizer's."""
  method = spec.model_cfg.sparsity.method
  sparsity = flax.core.unfreeze(jax.tree.map(lambda x: x, state.sparsity))
  if method.sparse and sparsity:
    for path in state_lib.sparse_layer_paths(sparsity):
      kernel = methods_base.kernel_at(params, path)
      layer = methods_base.per_layer(method.init_layer)(kernel)
      state_lib.get_path(sparsity, path[:-1])[path[-1]] = dict(layer)
  init_rng, _ = jax.random.split(jax.random.PRNGKey(spec.config.seed))
  params, sparsity, method_state = method.init_state(params, sparsity,
                                                     jax.random.fold_in(init_rng, 1))
  tx = spec.tx(params, sparsity)
  return state.replace(params=params, sparsity=sparsity, method_state=method_state,
                       opt_state=tx.init(params))


def init_from_hf(spec: RunSpec, state: state_lib.TrainState, path: str, *,
                 shardings: Any = None) -> state_lib.TrainState:
  """A new run's fresh `state` started from the Hugging Face directory at `path` (module
  docstring), with `shardings` (the fresh state's) for the result."""
  params = load_hf_params(spec.model_cfg, state.params, path, _tokenizer(spec))
  logging.info("init_from %s: the run starts from its weights", path)
  fn = jax.jit(functools.partial(_with_params, spec), out_shardings=shardings)
  return fn(state, params)


