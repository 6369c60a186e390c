"""What a backend of the sparse linear op is, and the registry that names them.

A backend is one implementation of the three GEMMs of y = x W~^T (one file each in this
package). The op (`sparse_ops.sparse_linear`) looks the backend up here, by
`GemmOptions.backend`, and nowhere else; a new backend is one file and one
`register_backend` call.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from s24jax.sparse_ops.options import GemmOptions

# (opts, x (N, in), W~ (out, in), key | None, prepared) -> y (N, out) in x's dtype, with the
# three-GEMM backward (a jax.custom_vjp); `prepared` is what `Backend.prepare` made, or {}.
LinearFn = Callable[[GemmOptions, jax.Array, jax.Array, "jax.Array | None", dict], jax.Array]
# (W~ (out, in), tokens per device, compute dtype, opts, micro-batches per step) -> {name: array}
PrepareFn = Callable[..., dict]
# (opts, W~'s shape (out, in), tokens per device, compute dtype, micro-batches per step) ->
# the gemm_choice.Choice of each GEMM of such a layer (forward, dgrad, wgrad), as the step
# makes them when it is traced.
ChoicesFn = Callable[..., list]


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation of the sparse linear op.

  linear:  the op on 2-D x (see LinearFn).
  prepare: optional; W~ in the form the backend multiplies (e.g. compressed), computed once
           per optimizer step by the train step (`sparse_linear.prepare`) and handed to every
           micro-batch's `linear` as `prepared`. None: the backend has nothing to prepare.
  check:   optional; raises ValueError naming what the backend cannot do with these options
           (FP8, a format). Called when the model config is built, not when a step is traced.
  needs_24: W~ must be 2:4 along `in` (compressed kernels); 'xla' takes any W~.
  fp8_backward: the FP8 format of W~ and x in the backward GEMMs that
           sparsity.fp8_backward_operands='auto' picks for this backend.
  choices: optional; the backend consults sparsity.gemm_choice (gemm_choice.py) and says
           what it picks for a layer (see ChoicesFn; the planner reports it). None: it
           ignores the policy.
  """
  linear: LinearFn
  prepare: PrepareFn | None = None
  check: Callable[[GemmOptions], None] | None = None
  needs_24: bool = True
  fp8_backward: str = "e4m3"
  choices: ChoicesFn | None = None


_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, backend: Backend, *, overwrite: bool = False) -> None:
  """Registers `backend` as `sparsity.backend = name`."""
  if name in _BACKENDS and not overwrite:
    raise ValueError(f"sparse_ops backend {name!r} is already registered; pass "
                     "overwrite=True to replace it.")
  _BACKENDS[name] = backend


def available_backends() -> tuple[str, ...]:
  return tuple(_BACKENDS)


def get_backend(name: str) -> Backend:
  try:
    return _BACKENDS[name]
  except KeyError:
    raise ValueError(f"unknown sparsity.backend {name!r}; valid: "
                     f"{', '.join(available_backends())}") from None


def check(opts: GemmOptions) -> None:
  """Raises ValueError unless the backend of `opts` exists and accepts the options."""
  backend = get_backend(opts.backend)
  if backend.check is not None:
    backend.check(opts)
  # 'xla' has no 2:4 kernel: every choice is its dense GEMMs. A backend with one that does
  # not consult the policy runs it wherever it can ('sparse'), or by its own rule
  # ('measured', the default); a GEMM forced dense would be silently ignored.
  if (backend.choices is None and backend.needs_24
      and opts.gemm_choice not in ("measured", "sparse")):
    raise ValueError(f"sparsity.gemm_choice={opts.gemm_choice!r} is consulted by "
                     f"sparsity.backend='cusparselt' only; {opts.backend!r} picks its "
                     "kernels itself (s24jax/sparse_ops/gemm_choice.py): leave it at "
                     "'measured', or use sparsity.backend='xla' for dense GEMMs.")


def no_fp8(name: str) -> Callable[[GemmOptions], None]:
  """A `Backend.check` for a backend without an FP8 path."""
  def check_(opts: GemmOptions) -> None:
    if opts.fp8:
      raise ValueError(f"sparsity.fp8 is not supported by sparsity.backend={name!r} (its "
                       "kernels have no FP8 path); use sparsity.backend='xla' or "
                       "'cusparselt'.")
  return check_
