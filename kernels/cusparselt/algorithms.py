"""The algorithm of a cuSPARSELt GEMM as data: `Algorithm`, the library's fastest one for a
GEMM (`search`), and whether one agrees with the library's default (`check_against_default`).

An Algorithm is what ops.spmm's FFI call carries (alg_id, split_k, split_k_mode,
split_k_buffers; cusparselt_ffi.cc sets them with cusparseLtMatmulAlgSetAttribute before it
plans the GEMM); DEFAULT (alg_id -1) is the library's default selection, nothing set. The
`cusparselt_search` FFI target (`search_call`, jittable) runs cusparseLtMatmulSearch, which
times every candidate on the operands it is given: `search` runs it on concrete arrays and
returns the fastest Algorithm with the number of algorithm ids (alg_config_max_id). Some
cuSPARSELt versions' alg ids gave wrong results (pytorch/pytorch#155333), so an algorithm is
worth checking against the default on the same operands before it is used:
`check_against_default`, within a bound derived from the arithmetic (`agreement_bound`).

Under the stand-in (ops.standin()) `search` returns (Algorithm(0), 1) without calling the
library, and ops.spmm ignores the algorithm (the stand-in has one arithmetic), so
`check_against_default` finds no disagreement.

Never run on a GPU: the search handler, spmm under a given algorithm, and so this module's
`gpu` tests (tests/kernels/test_cusparselt_algorithms.py); the CPU suite checks the calls'
wiring (a deviceless H100 compile), the stand-in path and the bound.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import library
from . import ops

# Accumulation of the sum of k products (the premise of agreement_bound). 16-bit operands:
# exact float32 products summed in float32, each addition erring by at most one float32 unit
# (2^-23, which also covers a truncating accumulator). FP8 operands: Hopper's and Ada's FP8
# tensor cores hold 14 significant bits and truncate (2^-13), once per product and twice per
# MMA instruction, which covers at least 32 of k (kernels/_testing.py's fp8_gemm_error_bound
# uses the same two facts, from here).
FLOAT32_ACCUMULATOR_UNIT = float(np.finfo(np.float32).eps)   # 2^-23
FP8_ACCUMULATOR_UNIT = 2.0 ** -13
FP8_MMA_MIN_K = 32
_INT32 = (-2 ** 31, 2 ** 31 - 1)


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """A cuSPARSELt algorithm for ops.spmm: the config id (-1: the library's default selection)
  and the split-K settings. A value at or below its default leaves the library's choice
  (library.ALGORITHM_DEFAULTS, which the handler reads the same way)."""
  alg_id: int
  split_k: int = library.ALGORITHM_DEFAULTS["split_k"]
  split_k_mode: int = library.ALGORITHM_DEFAULTS["split_k_mode"]
  split_k_buffers: int = library.ALGORITHM_DEFAULTS["split_k_buffers"]

  def __post_init__(self):
    for name, value in dataclasses.asdict(self).items():
      low = library.ALGORITHM_DEFAULTS[name] if name == "alg_id" else _INT32[0]
      if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
          or not low <= value <= _INT32[1]):
        raise ValueError(f"cuSPARSELt Algorithm: {name}={value!r} must be an int in "
                         f"[{low}, {_INT32[1]}] (the library's attributes are C ints)")
      object.__setattr__(self, name, int(value))

  def attrs(self) -> dict[str, int]:
    """The attributes ops.spmm's FFI call carries."""
    return dataclasses.asdict(self)


DEFAULT = Algorithm(**library.ALGORITHM_DEFAULTS)
# What cusparselt_search returns, in order: an Algorithm's fields, then the number of
# algorithm ids, alg_config_max_id (the valid ids are 0 .. max - 1).
SEARCH_RESULT = (*(f.name for f in dataclasses.fields(Algorithm)), "alg_config_max_id")
STANDIN_SEARCH = (Algorithm(0), 1)


def search_call(a_compressed: jax.Array, b: jax.Array, gemm: ops.Gemm, *, a_dtype,
                out_dtype) -> jax.Array:
  """The `cusparselt_search` FFI call on spmm's operands for `gemm` (D in `out_dtype`):
  int32[5] in SEARCH_RESULT's order. Jittable; the library times its candidates on the
  operands, so give it concrete ones of the GEMM to be run. The operands get spmm's own
  checks (shapes, the device, the library's rules), run abstractly."""
  jax.eval_shape(functools.partial(ops.spmm, gemm=gemm, a_dtype=a_dtype, out_dtype=out_dtype),
                 jax.ShapeDtypeStruct(a_compressed.shape, a_compressed.dtype),
                 jax.ShapeDtypeStruct(b.shape, b.dtype))
  if ops._STANDIN:   # pylint: disable=protected-access
    alg, max_id = STANDIN_SEARCH
    return jnp.asarray([*alg.attrs().values(), max_id], jnp.int32)
  library.register()
  call = jax.ffi.ffi_call("cusparselt_search",
                          jax.ShapeDtypeStruct((len(SEARCH_RESULT),), jnp.int32))
  return call(a_compressed, b, **gemm.attrs(), a_dtype=ops.dtype_name(a_dtype),
              d_dtype=ops.dtype_name(out_dtype))


def search(a_compressed: jax.Array, b: jax.Array, gemm: ops.Gemm, *, a_dtype,
           out_dtype) -> tuple[Algorithm, int]:
  """The library's fastest algorithm for `gemm` on these concrete operands, and the number of
  algorithm ids (alg_config_max_id): `search_call`, run and read back."""
  found = jax.jit(functools.partial(search_call, gemm=gemm, a_dtype=a_dtype,
                                    out_dtype=out_dtype))(a_compressed, b)
  try:
    *fields, max_id = (int(v) for v in np.asarray(found))
  except jax.errors.TracerArrayConversionError:
    raise TypeError("cusparselt search reads the library's choice back, so it runs on "
                    "concrete arrays; inside jit, call search_call") from None
  return Algorithm(*fields), max_id


def agreement_bound(op_a, op_b, *, a_dtype, out_dtype) -> jax.Array:
  """How far two algorithms' D (m, n) = op(A) (m, k) op(B) (k, n) may lie apart, elementwise
  (float32): both sum the same k products, in orders and splits that may differ, so each is
  within gamma(c, unit) * S of the exact sum, S = sum_i |a_i| |b_i| (Higham, "Accuracy and
  Stability of Numerical Algorithms", ch. 3, for any order; gamma(c, u) = c u / (1 - c u);
  unit and c from the accumulator above: k additions for 16-bit operands, k + 2 ceil(k / 32)
  truncations for FP8); the two results are then within 2 gamma S, about 2 k 2^-23 S for
  16-bit operands. Each is rounded once to `out_dtype` (half an ulp each: one ulp,
  eps(out_dtype) S, for the two), and a result below the output's smallest normal may be
  flushed to zero by one kernel and not the other: plus that smallest normal. `op_a`, `op_b`:
  the operands' values (any float dtype); `a_dtype`: the type the GEMM multiplies in."""
  op_a = jnp.abs(jnp.asarray(op_a, jnp.float32))
  op_b = jnp.abs(jnp.asarray(op_b, jnp.float32))
  k = op_a.shape[-1]
  if jnp.dtype(a_dtype).itemsize == 1:
    unit, roundings = FP8_ACCUMULATOR_UNIT, k + 2 * math.ceil(k / FP8_MMA_MIN_K)
  else:
    unit, roundings = FLOAT32_ACCUMULATOR_UNIT, k
  if roundings * unit >= 1:
    raise ValueError(f"cusparselt agreement_bound: k={k} is too long for a bound of "
                     f"{jnp.dtype(a_dtype).name} accumulation (k * unit >= 1)")
  gamma = roundings * unit / (1 - roundings * unit)
  out = jnp.finfo(out_dtype)
  abs_sum = jnp.matmul(op_a, op_b, precision=jax.lax.Precision.HIGHEST)        # S (m, n)
  return (2 * gamma + float(out.eps) * (1 + gamma)) * abs_sum + float(out.smallest_normal)


def disagreement(d_alg, d_default, bound, algorithm: Algorithm) -> str | None:
  """None if |d_alg - d_default| <= bound everywhere (NaN never is), else one line naming
  the algorithm, how many outputs differ and the worst of them."""
  got, want = np.asarray(d_alg, np.float64), np.asarray(d_default, np.float64)
  bound = np.broadcast_to(np.asarray(bound, np.float64), want.shape)
  diff = np.abs(got - want)
  bad = ~(diff <= bound)
  if not bad.any():
    return None
  i = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(diff - bound, nan=np.inf),
                                          -np.inf)), bad.shape)
  where = tuple(int(j) for j in i)
  return (f"cuSPARSELt {algorithm} disagrees with the default selection on {int(bad.sum())} "
          f"of {bad.size} outputs beyond the bound derived from the arithmetic; worst at D "
          f"array index {where}: {float(got[i])!r} vs {float(want[i])!r} (difference "
          f"{float(diff[i]):.3g}, bound {float(bound[i]):.3g}). Some library versions' alg "
          "ids give wrong results (pytorch/pytorch#155333): leave this GEMM at the default.")


def check_against_default(a_compressed: jax.Array, b: jax.Array, gemm: ops.Gemm,
                          algorithm: Algorithm, *, a_dtype, out_dtype) -> str | None:
  """Runs ops.spmm with `algorithm` and with DEFAULT on the same concrete operands: None if
  they agree within `agreement_bound`, else `disagreement`'s line. The bound needs |op(A)|,
  which the compressed form hides: it is read back through the library as op(A) I (a GEMM
  with the identity under the default selection, exact: one nonzero product per output, a
  value of `a_dtype`, which `out_dtype` holds exactly)."""
  def run(alg, g, x):
    return jax.jit(functools.partial(ops.spmm, gemm=g, a_dtype=a_dtype, out_dtype=out_dtype,
                                     alg=alg))(a_compressed, x)

  d_alg, d_default = run(algorithm, gemm, b), run(DEFAULT, gemm, b)
  identity_gemm = dataclasses.replace(gemm, n=gemm.k, d_row_major=True)        # D = op(A) I
  op_a = run(DEFAULT, identity_gemm, jnp.eye(gemm.k, dtype=b.dtype))           # (m, k)
  op_b = b if gemm.trans_b else b.T                                             # (k, n)
  bound = agreement_bound(op_a, op_b, a_dtype=a_dtype, out_dtype=out_dtype)     # (m, n)
  return disagreement(d_alg, d_default, bound if gemm.d_row_major else bound.T, algorithm)
