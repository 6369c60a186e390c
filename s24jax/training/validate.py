"""The whole run checked before anything is written: `check_run(config, workdir)`.

Every problem a user can fix is a `errors.UserError` that names the field (or file) and what
to do, raised before the workdir, its checkpoints or its logs are touched (the token cache,
outside the workdir, may be built). In order, cheapest and most likely first:

  the workdir    not a file, not a workdir of s24jax < 0.3 (`workdir.check`);
  the config     values and ranges (`check_fields`: steps, lr, batch, seq_len, fractions,
                 periods, ...), the batch against the accumulation and the devices, the mesh,
                 MVUE's tokens per micro-batch, then the run itself (`RunSpec.build`: the
                 method, the model, V:N:M, widths for 2:4, each dataclass's own checks);
  sparse layers  every pattern of `sparsity.sparse_layers` matches a layer of the model
                 (`check_sparse_layers`; opt-out: allow_unmatched_layers);
  the backend    a GPU backend can run on this process's device;
  checkpoints    the newest one fits the state this config builds; if not, the config fields
                 that differ from the config that wrote it (`check_checkpoints`);
  disk space     at least one checkpoint's size free (an error), a warning below a few;
  the data       the token cache (checked against its checksums), one window of
                 model.seq_len + 1 tokens in each split, every id inside model.vocab_size.

`check_config` (the config alone, no device, data or workdir) is what `python -m
s24jax.training.flops` and `python -m s24jax.perf.plan` run; `load_config` is the config loader of every
command line, with its errors as `UserError`.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from jax.experimental import multihost_utils

from s24jax.training import checkpoint as ckpt_lib
from s24jax import config_files
from s24jax import destinations
from s24jax import errors
from s24jax.training import init_from
from s24jax.training import platform_dtypes
from s24jax.training import sharding
from s24jax import sparse_ops
from s24jax import state as state_lib
from s24jax.training import workdir as workdir_lib
from s24jax.data import cache
from s24jax.data import sources
from s24jax.data import tokenizer
from s24jax.training.run_spec import RunSpec
from s24jax.errors import UserError

@dataclasses.dataclass(frozen=True)
class Checked:
  """What the checks built, for the run to reuse: the spec, the mesh, the token streams."""
  spec: RunSpec
  mesh: Any
  data: cache.TokenData


def load_config(spec: str, overrides=None, *, args=()) -> ml_collections.ConfigDict:
  """`config_files.load_config`, every error of it as one line (UserError): a missing file,
  one that does not run or has no get_config, an unknown variant, a bad override."""
  path = spec.partition(":")[0]
  if not os.path.isfile(path):
    what = f"is {workdir_lib.what_is(path)}" if os.path.lexists(path) else "not found"
    raise UserError(f"config file {path!r} {what} (expected FILE.py[:variant], e.g. "
                    "experiments/gpt2_s_ste.py:small)")
  with errors.user_errors(ValueError, TypeError, context=f"{spec}: "):
    return config_files.load_config(spec, overrides, args=args)


# ---------------------------------------------------------------------------------------------
# The config.


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(lo: int | None = None) -> Callable[[Any], str | None]:
  def rule(v):
    if not (isinstance(v, int) and not isinstance(v, bool)) or (lo is not None and v < lo):
      return f"an integer >= {lo}" if lo is not None else "an integer"
    return None
  return rule


def _real(lo: float, hi: float | None = None, *, lo_open=False, hi_open=True) -> Callable:
  def rule(v):
    ok = _number(v) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and (
        hi is None or (v < hi if hi_open else v <= hi))
    if ok:
      return None
    low = f"{'(' if lo_open else '['}{lo:g}, "
    high = (f"{hi:g}{')' if hi_open else ']'}" if hi is not None else "inf)")
    return f"a finite number in {low}{high}"
  return rule


def _optional(rule):
  return lambda v: None if v is None else rule(v)


# (dotted field, rule): the rule returns what the value must be, or None if it is fine.
FIELD_RULES: tuple[tuple[str, Callable[[Any], str | None]], ...] = (
    ("seed", _int(0)),
    ("total_steps", _int(1)),
    ("batch_size", _int(1)),
    ("grad_accum_steps", _int(1)),
    ("log_every", _int(1)),
    ("eval_every", _int(1)),
    ("eval_batches", _int(1)),
    ("checkpoint_every", _int(1)),
    ("keep_checkpoints", _int(1)),
    ("peak_flops", _real(0.0)),
    ("mesh.data", lambda v: None if v == -1 else _int(1)(v) and "-1 (the rest) or >= 1"),
    ("mesh.fsdp", lambda v: None if v == -1 else _int(1)(v) and "-1 (the rest) or >= 1"),
    ("model.seq_len", _int(1)),
    ("model.vocab_size", _int(1)),
    ("model.num_layers", _int(1)),
    ("model.num_heads", _int(1)),
    ("model.d_model", _int(1)),
    ("model.mlp_ratio", _real(0.0, lo_open=True)),
    ("optim.lr", _real(0.0, lo_open=True)),
    ("optim.min_lr", _real(0.0)),
    ("optim.warmup_steps", _int(0)),
    ("optim.b1", _real(0.0, 1.0)),
    ("optim.b2", _real(0.0, 1.0)),
    ("optim.eps", _real(0.0, lo_open=True)),
    ("optim.weight_decay", _real(0.0)),
    ("optim.grad_clip", _real(0.0)),
    ("data.val_fraction", _real(0.0, 1.0, lo_open=True)),
    ("data.max_docs", _optional(_int(1))),
    ("data.tokenizer", lambda v: None if v in tokenizer.TOKENIZERS
     else f"one of {', '.join(tokenizer.TOKENIZERS)}"),
    ("sparsity.dense_finetune_fraction", _real(0.0, 1.0)),
    ("sparsity.flip_rate_warn", _real(0.0)),
    ("act_sparsity.stats_sequences", _int(0)),
)


_MISSING = object()


def check_fields(config: ml_collections.ConfigDict) -> None:
  """Values and ranges of the run's fields (a field the config lacks is not checked)."""
  for field, rule in FIELD_RULES:
    value = config_files.get_field(config, field, _MISSING)
    if value is _MISSING:
      continue
    want = rule(value)
    if want:
      raise UserError(f"config.{field}={value!r}: must be {want}")
  lr = config_files.get_field(config, "optim.lr")
  min_lr = config_files.get_field(config, "optim.min_lr")
  if _number(lr) and _number(min_lr) and min_lr > lr:
    raise UserError(f"config.optim.min_lr={min_lr!r} is above config.optim.lr={lr!r}: the "
                    "schedule decays from lr to min_lr (min_lr <= lr)")
  stop = config_files.get_field(config, "stop_at_step", -1)
  total = config_files.get_field(config, "total_steps")
  if stop != -1 and not (isinstance(stop, int) and 1 <= stop <= total):
    raise UserError(f"config.stop_at_step={stop!r}: must be -1 (off) or a step in [1, "
                    f"total_steps={total}]")
  dtype = config_files.get_field(config, "model.dtype", "auto")
  if dtype != "auto":
    try:
      ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
      ok = False
    if not ok:
      raise UserError(f"config.model.dtype={dtype!r}: must be 'auto' or a float dtype "
                      "('float32', 'bfloat16', 'float16')")


def check_batch(config, num_devices: int) -> None:
  """The batch splits into `grad_accum_steps` micro-batches, each split over the devices
  (and the processes)."""
  b, k = int(config.batch_size), int(config.grad_accum_steps)
  if b % k:
    raise UserError(f"config.grad_accum_steps={k} must divide config.batch_size={b}")
  if (b // k) % num_devices:
    raise UserError(f"the micro-batch (config.batch_size / config.grad_accum_steps = {b // k} "
                    f"sequences) must be divisible by the {num_devices} devices it is split "
                    "over; change config.batch_size or config.grad_accum_steps")


def _mesh(config, devices) -> Any:
  mesh_cfg = config_files.get_field(config, "mesh")
  with errors.user_errors(context="config.mesh: "):
    return sharding.make_mesh(mesh_cfg, devices)


def _width_hint(config, error: str) -> str:
  """Where the layer widths come from, for an error about one that is not a multiple of 4."""
  m = config.model
  hidden = int(m.mlp_ratio * m.d_model)
  if "multiple of 4" in error and (m.d_model % 4 or hidden % 4):
    return (f" (the widths come from config.model.d_model={m.d_model} and "
            f"config.model.mlp_ratio * d_model = {hidden}; a 2:4 sparse layer needs its input "
            "width to be a multiple of 4)")
  return ""


def check_config(config: ml_collections.ConfigDict, *, num_devices: int | None = None,
                 allow_unmatched_layers: bool = False) -> RunSpec:
  """The config alone (values, ranges, the method, the model, the sparse layers), and the
  batch against `num_devices` if given. Returns the run's spec (built once)."""
  check_fields(config)
  if num_devices is not None:
    check_batch(config, num_devices)
  try:
    with errors.user_errors(ValueError, TypeError):
      spec = RunSpec.build(config)
  except UserError as e:
    raise UserError(f"{e}{_width_hint(config, str(e))}") from e.__cause__
  _check_mvue(config, spec)
  check_sparse_layers(spec, allow_unmatched=allow_unmatched_layers)
  sparse_ops.gemm_choice.warn_if_ignored(spec.model_cfg.sparsity, sparse_ops)   # said, not ignored
  return spec


def _check_mvue(config, spec: RunSpec) -> None:
  """MVUE makes dY^T 2:4 along the tokens: the tokens of a micro-batch (and of a chunk of a
  sparse head's chunked loss) must be a multiple of 4 (found here, not at the first trace)."""
  sp = spec.model_cfg.sparsity
  if not (sp.mvue and spec.method.sparse and spec.sparse_shapes):
    return
  tokens = config.batch_size // config.grad_accum_steps * spec.model_cfg.seq_len
  if tokens % 4:
    raise UserError(f"config.sparsity.mvue=True needs the tokens of a micro-batch "
                    f"(batch_size / grad_accum_steps x model.seq_len = {tokens}) to be a "
                    "multiple of 4")
  chunk, head = spec.model_cfg.loss_chunk, _head_name(spec)
  if head in spec.sparse_shapes and chunk and chunk % 4:
    raise UserError(f"config.sparsity.mvue=True with a sparse head ({head!r}) needs "
                    f"config.model.loss_chunk={chunk} to be a multiple of 4")


def _head_name(spec: RunSpec) -> str:
  return getattr(spec.model_cfg, "head_name", state_lib.HEAD)


def layer_paths(spec: RunSpec) -> list[str]:
  """The module paths sparsity.sparse_layers is matched against: every linear layer and the
  LM head (GPT-2's tied embedding 'wte')."""
  kernels = state_lib.linear_kernel_shapes(spec.abstract_state.params)
  return sorted(set(kernels) | {_head_name(spec)})


def check_sparse_layers(spec: RunSpec, *, allow_unmatched: bool = False) -> None:
  """A sparse method whose `sparsity.sparse_layers` has a pattern that matches no layer (a
  typo, another depth, scanned blocks named 'h') would silently train those layers dense:
  an error naming the patterns and the layers that exist; a warning with the opt-out."""
  if not spec.method.sparse:
    return
  patterns = tuple(spec.model_cfg.sparsity.sparse_layers)
  paths = layer_paths(spec)
  unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(x, p) for x in paths)]
  if patterns and not unmatched:
    return
  shown = ", ".join(paths[:24]) + (f", ... ({len(paths)} in all)" if len(paths) > 24 else "")
  what = (f"pattern(s) {unmatched} of config.sparsity.sparse_layers={patterns} match no layer"
          if patterns else "config.sparsity.sparse_layers is empty")
  sparse = sorted(spec.sparse_shapes)
  then = (f"only {sparse} would be sparse" if sparse else
          f"no layer would be sparse: method {spec.method.name!r} would train a dense model")
  message = f"{what}: {then}. The layers are: {shown} (glob patterns, e.g. '*/mlp/*')"
  if not allow_unmatched:
    raise UserError(f"{message}; fix the patterns, or pass --allow_unmatched_sparse_layers "
                    "(train_and_evaluate(..., allow_unmatched_layers=True)) to run anyway")
  logging.warning("UNMATCHED SPARSE LAYERS (allowed): %s", message)


def check_backend_device(spec: RunSpec) -> None:
  """A GPU backend (cuSPARSELt, tcgen05) must find its GPU in this process: said now, not
  at the first trace."""
  sp = spec.model_cfg.sparsity
  if not (spec.method.sparse and spec.sparse_shapes):
    return
  # pylint: disable=g-import-not-at-top
  if sp.backend == "cusparselt":
    from s24jax.kernels.cusparselt import ops as cusparselt_ops
    try:
      cusparselt_ops.check_device(jnp.float8_e4m3fn if sp.fp8 else jnp.bfloat16)
    except cusparselt_ops.UnsupportedDevice as e:
      raise UserError(str(e)) from e
  elif sp.backend == "tcgen05":
    from s24jax.kernels import tcgen05
    with errors.user_errors(tcgen05.NotBlackwellError):
      tcgen05.check_device()


# ---------------------------------------------------------------------------------------------
# The workdir, its checkpoints, the disk.


def check_workdir(workdir: str) -> None:
  with errors.user_errors(ValueError):
    workdir_lib.check(workdir)


def check_checkpoints(config, spec: RunSpec, workdir: str) -> None:
  """The newest checkpoint (whose metadata can be read) against the state this config
  builds; a mismatch names the config fields that differ from the config that wrote it."""
  found = ckpt_lib.find_mismatch(os.path.join(workdir, ckpt_lib.CHECKPOINTS),
                                 spec.abstract_state)
  if found is None:
    return
  step, state_diff = found
  old = workdir_lib.last_config(workdir)
  changed = workdir_lib.changed_fields(old, workdir_lib.as_json(config)) if old else {}
  fields = "; ".join(f"{k}: {v['was']!r} -> {v['now']!r}" for k, v in list(changed.items())[:12])
  if len(changed) > 12:
    fields += f"; ... ({len(changed)} fields in all)"
  if changed:
    source = f"the config that wrote it ({workdir_lib.last_config_path(workdir)}): {fields}"
  elif old:
    source = ("the config that wrote it: none, so the train state's layout changed (another "
              "s24jax version?)")
  else:
    source = "the config that wrote it: unknown (the workdir has no config.json)"
  raise ckpt_lib.CheckpointMismatchError(
      f"the checkpoint at step {step} in {workdir} does not match this config. Fields that "
      f"differ from {source}. Train state: {state_diff}. Nothing in the workdir was changed: "
      "run with the config that wrote it, or use a new --workdir.")


# ---------------------------------------------------------------------------------------------
# The data.


def load_tokens(config) -> cache.TokenData:
  """The token streams (the cache prepared once, checked against its checksums); with several
  processes, process 0 prepares the cache while the others wait at a barrier (so they never
  race to write it). Problems with the data are UserErrors."""
  root = str(sources.cache_root(config.data.get("cache_dir")))
  with destinations.writing(f"the token cache in {root}", "Its complete entries are intact; "
                            "nothing was written in the workdir", root), \
       errors.user_errors(ValueError, FileNotFoundError, NotADirectoryError, PermissionError,
                          context="config.data: "):
    if jax.process_count() > 1:
      if jax.process_index() == 0:
        cache.load_tokens(config.data)
      multihost_utils.sync_global_devices("s24jax: token cache prepared")
    data = cache.load_tokens(config.data)
  check_data(config, data)
  return data


def check_data(config, data: cache.TokenData) -> None:
  """Every id inside the model's vocabulary; one window of seq_len + 1 tokens per split."""
  vocab = int(config.model.vocab_size)
  if data.vocab_size > vocab:
    raise UserError(
        f"config.data.tokenizer={config.data.get('tokenizer', 'gpt2')!r} has {data.vocab_size} "
        f"token ids but config.model.vocab_size is {vocab}; set "
        f"config.model.vocab_size >= {data.vocab_size}")
  if data.max_id is not None and data.max_id >= vocab:
    raise UserError(f"the token cache of {data.name} holds id {data.max_id}, outside "
                    f"config.model.vocab_size={vocab}; set config.model.vocab_size > "
                    f"{data.max_id} (or delete the cache entry to rebuild it)")
  window = int(config.model.seq_len) + 1
  for split, tokens in (("train", data.train), ("val", data.val)):
    hint = " (data.val_fraction sets the share held out)" if split == "val" else ""
    if len(tokens) < window:
      raise UserError(
          f"config.data: the {split} split of {data.name} has {len(tokens)} tokens, fewer "
          f"than one window of config.model.seq_len + 1 = {window}; lower model.seq_len or "
          f"give more text{hint}")


# ---------------------------------------------------------------------------------------------
# The run.


def check_run(config: ml_collections.ConfigDict, workdir: str, *,
              allow_unmatched_layers: bool = False) -> Checked:
  """Everything above, in the module docstring's order; writes nothing in the workdir."""
  check_workdir(workdir)
  devices = jax.devices()
  spec = check_config(config, num_devices=len(devices),
                      allow_unmatched_layers=allow_unmatched_layers)
  mesh = _mesh(config, devices)
  check_backend_device(spec)
  platform_dtypes.check(spec.model_cfg.dtype)
  check_checkpoints(config, spec, workdir)
  step = ckpt_lib.newest_step_on_disk(workdir)
  if config.get("init_from") and step is None:
    init_from.check_init_from(spec)
  elif config.get("init_from"):   # a resumed run starts from its checkpoint instead
    logging.warning("config.init_from=%r is not used: the run resumes from its checkpoint at "
                    "step %d (init_from only starts a new run: use a new --workdir)",
                    config.init_from, step)
  ckpt_lib.check_disk(spec.abstract_state, workdir)
  data = load_tokens(config)
  workdir_lib.warn_if_data_changed(workdir, data, step)
  return Checked(spec=spec, mesh=mesh, data=data)
