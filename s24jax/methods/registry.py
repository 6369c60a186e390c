"""The method registry: name -> a method with its default hyper-parameters.

    from s24jax.methods import registry
    registry.register_method("mine", MyMethod())        # a base.Method subclass instance
    registry.register_projection("my24", my24)          # a plain w -> w~ function
    config.sparsity.method = "mine"

`from_config` builds the run's method from `config.sparsity.method` and its block
`config.sparsity.<name>`, validated and configured with the run's facts.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from s24jax.methods import base
from s24jax.methods import dense
from s24jax.methods import function
from s24jax.methods.mst import method as mst
from s24jax.methods import s_ste
from s24jax.methods import sr_ste
from s24jax.methods import ste
from s24jax.methods import t_sr_ste

_REGISTRY: dict[str, base.Method] = {}


def register_method(name: str, method: base.Method, *, overwrite: bool = False) -> base.Method:
  """Registers `method` (an instance: its field values are the defaults of its config block)
  so that `config.sparsity.method = name` trains with it. Re-registering a name needs
  overwrite=True, so a typo in a notebook cannot silently replace a built-in."""
  if not isinstance(method, base.Method):
    raise TypeError(f"register_method needs a Method instance, got {method!r} (a plain "
                    "projection function goes through register_projection)")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"method {name!r} is already registered; pass overwrite=True to "
                     "replace it.")
  method = dataclasses.replace(method, name=name)
  hash(method)   # the model closes over it: it must be hashable (a jit static argument)
  _REGISTRY[name] = method
  return method


def register_projection(name: str, fn: Callable[[jax.Array], jax.Array], *,
                        overwrite: bool = False) -> base.Method:
  """Registers a plain function w -> w_tilde (usually a jax.custom_vjp) as a stateless
  method (`function.FunctionProjection`)."""
  if isinstance(fn, base.Method):
    return register_method(name, fn, overwrite=overwrite)
  if not callable(fn):
    raise TypeError(f"register_projection needs a callable, got {fn!r}")
  return register_method(name, function.FunctionProjection(fn=fn), overwrite=overwrite)


def available_methods() -> tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def get_method(name: str) -> base.Method:
  """The registered method `name` with its default hyper-parameters."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"unknown method (sparsity.method) {name!r}; valid: "
                     f"{', '.join(available_methods())}") from None


def config_blocks() -> dict[str, dict[str, Any]]:
  """{method name: its config block} for every registered method (base_config uses it)."""
  return {name: m.config_block() for name, m in sorted(_REGISTRY.items())}


def check_renamed_keys(config) -> None:
  """A config (an old experiment file, or a resumed workdir's config.json) that still uses
  the key renamed in 0.3 gets an error naming the new one, not a silent default."""
  if "projection" in config.sparsity:
    raise ValueError("config.sparsity.projection was renamed to config.sparsity.method (it "
                     "selects the training method); set --config.sparsity.method="
                     f"{config.sparsity['projection']!r} instead")


def from_config(config, facts: base.RunFacts | None = None) -> base.Method:
  """The method `config.sparsity.method` with the hyper-parameters of its block, validated
  and configured with the run's facts (built from `config` unless given)."""
  check_renamed_keys(config)
  method = get_method(config.sparsity.method)
  block = dict(config.sparsity.get(method.name, None) or {})
  valid = set(method.config_block())
  unknown = sorted(set(block) - valid)
  if unknown:
    raise ValueError(f"unknown fields {unknown} in config.sparsity.{method.name}; valid: "
                     f"{sorted(valid)}")
  block = {k: tuple(v) if isinstance(v, list) else v for k, v in block.items()}
  facts = base.RunFacts.from_config(config) if facts is None else facts
  return dataclasses.replace(method, **block).configure(facts)


for _name, _method in [("dense", dense.Dense()), ("ste", ste.STE()), ("sr_ste", sr_ste.SRSTE()),
                       ("t_sr_ste", t_sr_ste.TSRSTE()), ("s_ste", s_ste.SSTE()),
                       ("mst", mst.MST())]:
  register_method(_name, _method)
