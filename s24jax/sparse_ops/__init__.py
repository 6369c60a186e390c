"""The fully sparse linear op: all three GEMMs of a linear layer 2:4 sparse (Hu et al. 2024).

For y = x W~^T with x (N, in) tokens and W~ (out, in) the projected weight
(docs/algorithms.md, Notation):

  forward   y  = x W~^T          W~ is 2:4 along `in`
  data grad dX = dY W~           W~ is 2:4 along `out` too when its mask is transposable
                                 (method 't_sr_ste'), so this GEMM can be sparse as well
  weight    dW~ = MVUE(dY^T) x   dY^T (out, N) made 2:4 along the tokens by the unbiased
  grad                           estimator `masks.mvue24` when `mvue` is on; plain dY^T x
                                 otherwise

The op is a `jax.custom_vjp` over (x, W~, key): it sits *after* the projection W -> W~ (whose
own backward rule, e.g. straight-through plus masked decay, maps dW~ to dW) and before
nothing else, so methods and GEMMs stay independent. The bias is added by the caller and its
gradient stays dense. Its static options are one `GemmOptions` (options.py), built by the
model from its `SparsityConfig`.

One file per backend (`sparsity.backend`), registered below; `get_backend` is the one place
a backend is chosen:

  xla.py          'xla': the reference (plain XLA matmuls on W~), any W~, FP8
  pallas.py       'pallas' (the Pallas kernels where they are expected to win, 'xla'
                  elsewhere: always on a CPU) and 'pallas_always' (every layer)
  tcgen05.py      'tcgen05': Blackwell's 2:4 tensor cores (compiled for B200, never run)
  cusparselt.py   'cusparselt': cuSPARSELt on A100 / H100 (compiled, never run), FP8, W~
                  compressed once per step (`prepare`), per device under a mesh

with common.py (the reference GEMMs, the MVUE operand, FP8 scaling, the key's cotangent),
backend.py (`Backend`, the registry) and gemm_choice.py (`sparsity.gemm_choice`: which GEMMs
run on a backend's 2:4 kernel; 'cusparselt' consults it) with gemm_times.py (the measured
times it reads: a table file, this machine's cache, the device). A new backend
is one file and one `register_backend` call.

The key: MVUE needs randomness in the backward pass. The caller passes a PRNG key per layer
and per step (`SparseLinear` draws it with `make_rng('mvue')` from the `rngs={'mvue': ...}`
that `train.train_step` derives from fold_in(state.rng, step)). A key of None is fine for a
forward-only call; differentiating with mvue on and no key raises.
"""
from __future__ import annotations

import jax

from s24jax.sparse_ops import cusparselt
from s24jax.sparse_ops import gemm_choice
from s24jax.sparse_ops import gemm_times
from s24jax.sparse_ops import pallas
from s24jax.sparse_ops import tcgen05
from s24jax.sparse_ops import xla
from s24jax.sparse_ops.backend import (Backend, available_backends, check, get_backend,
                                       register_backend)
from s24jax.sparse_ops.options import FP8_BACKWARD_AUTO
from s24jax.sparse_ops.options import FP8_BACKWARD_OPERANDS
from s24jax.sparse_ops.options import GemmOptions

__all__ = ["Backend", "GemmOptions", "FP8_BACKWARD_AUTO", "FP8_BACKWARD_OPERANDS", "available_backends", "check",
           "gemm_choice", "gemm_times", "get_backend", "register_backend", "sparse_linear"]

for _name, _backend in [("xla", xla.BACKEND), ("pallas", pallas.BACKEND),
                        ("pallas_always", pallas.ALWAYS), ("tcgen05", tcgen05.BACKEND),
                        ("cusparselt", cusparselt.BACKEND)]:
  register_backend(_name, _backend)


def sparse_linear(x: jax.Array, w: jax.Array, key: jax.Array | None = None,
                  opts: GemmOptions = GemmOptions(), prepared: dict | None = None
                  ) -> jax.Array:
  """y = x W~^T for x (..., in) and a 2:4 W~ (out, in), with the three-GEMM backward.

  Args:
    x: activations (..., in); the compute dtype (y and dX come back in it).
    w: the projected weight W~ (out, in), already 2:4 (the method's projection); its
      gradient comes back in w's dtype.
    key: PRNG key for MVUE (per layer, per step); only used when `opts.mvue` and
      differentiated.
    opts: the GEMMs' options (options.GemmOptions), including the backend.
    prepared: what the backend's `prepare` made of W~ for this step; None: the backend
      prepares nothing, or does it in this call.

  Returns:
    y (..., out) in x's dtype, accumulated in float32.
  """
  if x.shape[-1] != w.shape[-1]:
    raise ValueError(f"sparse_linear: x has {x.shape[-1]} input features (last axis of "
                     f"{tuple(x.shape)}) but W~ {tuple(w.shape)} expects {w.shape[-1]}.")
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1])                                    # (N, in)
  y = get_backend(opts.backend).linear(opts, x2, w, key, prepared or {})   # (N, out)
  return y.reshape(*lead, w.shape[0])                                # (..., out)
