"""Experiment config files and `path.to.field=value` overrides: the one loader every CLI uses.

    config = config_files.load_config("experiments/gpt2_s_ste.py:tiny", {"total_steps": 100})
    config = config_files.load_config("experiments/gpt2_s_ste.py:tiny",
                                      args=["total_steps=100", "sparsity.mvue=False"])

A config file defines `get_config(variant=None)`; `FILE.py:VARIANT` passes VARIANT (no colon:
None). launch.py (`--config.path.to.field=value`), `python -m s24jax.cli.flops CONFIG
path.to.field=value ...` and `python -m s24jax.perf.plan --set path.to.field=value` all go through
`parse_overrides`, so a value means the same everywhere:

- the text is read as a Python literal (`ast.literal_eval`: 3, 1e-4, True, None, tuples such as
  "('*/attn/*','*/mlp/*')"); text that is no literal is the plain string (`data.name=lm1b`);
- the value must fit the field's type: a str field takes the text as written (`data.name=123` is
  '123'), a bool field also takes true/false, a float field an int, a tuple field a list or one
  bare element (a one-element tuple); None only sets a field that is None (a placeholder);
- an unknown field is an error naming the valid fields of its parent (and close matches).
Every such problem raises `OverrideError` (a ValueError).

Overrides given as Python values (`load_config(spec, {"seed": 1})`, the comparison scripts) are
type-checked the same way. The config is locked: no override or later code can add a field.
This module imports no data pipeline, model or tool (it reads experiment files only).

A config file that cannot be run is a `ConfigFileError` (a UserError: one line naming the file
and, for an exception in its code, the line it came from): a file that does not parse, an
import that fails in it, no `get_config`, an exception inside `get_config` (its own ValueError
or TypeError, e.g. an unknown variant, keeps its message and type).
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import traceback
from typing import Any, Iterable, Mapping

import ml_collections

from s24jax import errors

_MISSING = object()


class OverrideError(ValueError):
  """An override names no field, or its value does not fit the field."""


class ConfigFileError(errors.UserError):
  """A config file that cannot be run (module docstring)."""


def _origin(e: BaseException, path: str) -> str:
  """' (at FILE:LINE)': the deepest line of the config file `path` the exception went
  through, else the deepest line of Python source (not the import machinery's)."""
  frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]
  ours = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(path)]
  frame = (ours or frames or [None])[-1]
  return f" (at {frame.filename}:{frame.lineno})" if frame else ""


def _get_config(path: str, variant: str | None) -> Any:
  """Runs the config file at `path` and calls its get_config(variant)."""
  mod_spec = importlib.util.spec_from_file_location("_s24jax_config_file", path)
  if mod_spec is None:
    raise ConfigFileError(f"config file {path!r}: not a Python file (expected "
                          "FILE.py[:variant], e.g. experiments/gpt2_s_ste.py:small)")
  module = importlib.util.module_from_spec(mod_spec)
  try:
    mod_spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ConfigFileError(f"config file {e.filename or path}:{e.lineno}: {e.msg}") from e
  except errors.KnownError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigFileError(f"config file {path}: running it raised {type(e).__name__}: "
                          f"{e}{_origin(e, path)}") from e
  get_config = getattr(module, "get_config", None)
  if not callable(get_config):
    raise ConfigFileError(f"config file {path} defines no get_config(variant=None) returning "
                          "an ml_collections.ConfigDict (as experiments/gpt2_ste.py does)")
  try:
    return get_config(variant or None)
  except (errors.KnownError, ValueError, TypeError):
    raise   # the file's own messages for the user (e.g. an unknown variant)
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigFileError(f"config file {path}: get_config({variant or None!r}) raised "
                          f"{type(e).__name__}: {e}{_origin(e, path)}") from e


def load_config(spec: str, overrides: Mapping[str, Any] | None = None, *,
                args: Iterable[str] = ()) -> ml_collections.ConfigDict:
  """`get_config(variant)` of `path/to/file.py[:variant]`, with `overrides` (dotted path ->
  Python value) and then `args` ('dotted.path=text', parsed by `parse_overrides`) applied."""
  path, _, variant = spec.partition(":")
  config = _get_config(path, variant)
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigFileError(f"{path}: get_config() returned {type(config).__name__}, not a "
                          "ConfigDict")
  config.lock()
  apply_overrides(config, overrides or {})
  apply_overrides(config, parse_overrides(config, args))
  return config


def sibling_config(file: str, name: str, variant: str | None = None, **kwargs
                   ) -> ml_collections.ConfigDict:
  """`get_config(variant, **kwargs)` of the experiment file `name`.py in `file`'s folder: a
  recipe written once and run with other arguments (experiments/llama_*.py run the GPT-2
  recipes with family='llama')."""
  path = os.path.join(os.path.dirname(os.path.abspath(file)), f"{name}.py")
  mod_spec = importlib.util.spec_from_file_location(f"_s24jax_config_{name}", path)
  module = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(module)
  return module.get_config(variant, **kwargs)


def get_field(config: Any, dotted: str, default: Any = None) -> Any:
  """config's field at 'path.to.field' (through ConfigDicts and dicts), or `default` if any
  part of the path is missing."""
  node = config
  for part in dotted.split("."):
    if not isinstance(node, (ml_collections.ConfigDict, dict)) or part not in node:
      return default
    node = node[part]
  return node


def split_override(item: str) -> tuple[str, str]:
  """'a.b=text' -> ('a.b', 'text')."""
  key, eq, text = item.partition("=")
  if not eq or not key:
    raise OverrideError(f"override {item!r}: expected path.to.field=value")
  return key.strip(), text


def parse_overrides(config: ml_collections.ConfigDict,
                    items: Iterable[str]) -> dict[str, Any]:
  """'path.to.field=text' items -> {path: value}, each text read against its field's type
  (module docstring). A field given twice keeps the last value."""
  out = {}
  for item in items:
    key, text = split_override(item)
    out[key] = parse_value(config, key, text)
  return out


def parse_value(config: ml_collections.ConfigDict, key: str, text: str) -> Any:
  """The value `text` sets field `key` of `config` to (module docstring)."""
  field_type, current = _field(config, key)
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    value = _MISSING
  if field_type is str and not isinstance(value, str) and not (value is None and current is None):
    return text                                   # a str field takes the text as written
  if field_type is bool and text in ("true", "false"):
    return text == "true"
  if value is _MISSING:
    if field_type is tuple:
      return (text,)
    if field_type in (type(None), object):
      return text
    raise OverrideError(f"override {key}={text}: the field is {field_type.__name__} "
                        f"(now {current!r}); {text!r} is not a Python literal")
  return _checked(key, field_type, current, value)


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """Sets each dotted path to its value, type-checked against the field (module docstring)."""
  for key, value in overrides.items():
    field_type, current = _field(config, key)
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = _checked(key, field_type, current, value)
  return config


def _field(config: ml_collections.ConfigDict, key: str) -> tuple[type, Any]:
  """(type, current value) of the field at dotted path `key`; a clear error if there is none."""
  node, walked = config, []
  parts = key.split(".")
  for i, part in enumerate(parts):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise OverrideError(_unknown_field_message(config, key, node, walked))
    if i == len(parts) - 1:
      return node.get_type(part), node[part]
    node = node[part]
    walked.append(part)
  raise AssertionError(key)


def _checked(key: str, field_type: type, current: Any, value: Any) -> Any:
  """`value`, converted where lossless (int -> float, list -> tuple, x -> (x,)), or an
  OverrideError naming the field's type."""
  if value is None:
    if current is None:
      return None
  elif field_type in (type(None), object):
    return value
  elif field_type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  elif field_type is tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
  elif issubclass(field_type, ml_collections.ConfigDict):
    raise OverrideError(f"override {key}: a group of fields ({', '.join(current.keys())}); "
                    f"set them one by one ({key}.FIELD=...)")
  elif isinstance(value, field_type) and not (field_type is int and isinstance(value, bool)):
    return value
  raise OverrideError(f"override {key}={value!r}: the field is {field_type.__name__} "
                  f"(now {current!r}), not {type(value).__name__}")


def _leaf_paths(node: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  out = []
  for k in node.keys():
    v = node[k]
    if isinstance(v, ml_collections.ConfigDict):
      out += _leaf_paths(v, f"{prefix}{k}.")
    else:
      out.append(prefix + k)
  return out


def _unknown_field_message(config, key: str, node, walked: list[str]) -> str:
  where = ".".join(walked) or "the config"
  if isinstance(node, ml_collections.ConfigDict):
    valid = f"its fields: {', '.join(sorted(node.keys()))}"
  else:
    valid = f"{where} is a value, not a group of fields"
  close = difflib.get_close_matches(key, _leaf_paths(config), n=3, cutoff=0.6)
  hint = f"; did you mean {', '.join(close)}?" if close else ""
  return f"override {key!r}: no such field in {where} ({valid}){hint}"
