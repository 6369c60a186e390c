"""V:N:M activation sparsity for the FFN (Haziza et al. 2025/2026) and its statistics.

The recipe (docs/algorithms.md, "Activation sparsity, V:N:M"): a Squared-ReLU FFN whose hidden
activations h = relu(x W1^T)^2, the input of the second FFN matmul, are made V:N:M sparse
in the forward pass (VENOM: blocks of V token-rows x M hidden columns; 4 columns chosen per
block, shared by its V rows; every row keeps its N largest of those 4), combined with 2:4
weights, trained sparse for most steps and dense at the end.

Rows and columns. h is (B, T, H); every leading axis is flattened into rows (tokens, B*T)
and H, the contraction axis of the second matmul, holds the columns. When the token count
is not a multiple of V the rows are padded with zeros to the next multiple and the padding
is dropped again: a zero row adds nothing to any column subset's score, so the last,
partial block is masked exactly as a block of just its real rows would be (tested). We pad
rather than raise because the same model also runs on odd token counts (init on one
sequence, eval, generation); training shapes are multiples of V anyway.

Gradient. Straight-through on the kept entries: d(in) = d(out) * mask (a custom_vjp that
saves only the bool mask). The mask is a function of h, but a piecewise-constant one, so
this is also what autodiff of h * mask(h) gives almost everywhere; the custom rule makes it
explicit and keeps the mask search (sorts, argmax) out of the backward pass.

Backends (`act_sparsity.backend`, the seam for the VENOM kernel). A backend selects the
mask (and whatever metadata its matmul needs) and, optionally, does the second matmul:
  'xla'    the reference: `masks.venom_select` (exact, plain jnp), then the layer's own
           matmul (`sparse_linear.linear`) on the masked activation;
  'pallas' kernels/venom.py: selection + compression in one kernel, the forward matmul from
           the compressed activations (N = 2 only; dense backward matmuls). The proj layer's
           matmul is replaced (`SparseLinear(matmul=...)`), so its 2:4 weight kernels/MVUE
           do not apply there; the weight is still projected (2:4) before the matmul.
More register with `register_act_backend(name, ActBackend(select, matmul))`.

Measurement (natural activation sparsity). When the model is applied with the
'intermediates' collection mutable (and only then: training and eval steps pay nothing),
every MLP sows, for its activation h before any V:N:M masking:
  zero_frac: the fraction of exact zeros of h;
  kept_l1:   sum |h * mask| / sum |h|, the share of L1 magnitude a V:N:M mask keeps.
L1 because it is exactly what the VENOM column choice maximises (the kept |h|); kept_l1 = 1
means the activations already were V:N:M sparse, 0.25 (2:8) is what a flat h would keep.
The loop's chore that runs that forward pass on the step's batch and logs the statistics
(`config.act_sparsity.stats_sequences`) is with the run's other measurements, in
s24jax/training/diagnostics.py (`activation_stats`, `stats_chores`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from s24jax.kernels._common import interpret_default
from s24jax.kernels import masks
from s24jax.kernels import venom

KINDS = ("none", "venom")
# Names of the sown statistics (per MLP) and their metric prefix: `act/<stat>/<layer>`.
STATS = ("zero_frac", "kept_l1")


@dataclasses.dataclass(frozen=True)
class ActSparsityConfig:
  """V:N:M sparsity of the FFN activations feeding the second FFN matmul (`config.act_sparsity`
  minus `stats_sequences`); composes with any weight method."""
  kind: str = "none"        # 'none' or 'venom'
  v: int = 64               # rows (tokens) per block
  n: int = 2                # kept per row among the block's 4 chosen columns
  m: int = 8                # columns per block (hidden units, the contraction axis)
  backend: str = "xla"      # 'xla' (reference) or 'pallas' (kernels/venom.py); see above

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"unknown act_sparsity.kind {self.kind!r}; valid: {', '.join(KINDS)}")
    if self.v < 1 or self.m < 4 or not 0 <= self.n <= 4:
      raise ValueError("V:N:M activation sparsity needs act_sparsity.v >= 1, m >= 4 and "
                       f"0 <= n <= 4 (n of the 4 chosen columns); got v={self.v}, "
                       f"n={self.n}, m={self.m}")

  @property
  def enabled(self) -> bool:
    return self.kind != "none"

  def describe(self) -> str:
    return f"{self.kind} act {self.v}:{self.n}:{self.m}" if self.enabled else ""


@dataclasses.dataclass(frozen=True)
class ActBackend:
  """How V:N:M activations are selected and multiplied (see the module docstring).

  select(h (R, H), v, n, m) -> (mask (R, H) bool, meta): R is a multiple of v; meta is any
    pytree of arrays the matmul needs (for 'xla' the chosen columns, (R/v, H/m, 4)).
  matmul(h_sparse (R, H), meta, w (out, H)) -> y (R, out), differentiable with respect to
    h_sparse and w; None: the layer's own matmul (`sparse_linear.linear`) on h_sparse.
  """
  select: Callable[..., tuple[jax.Array, Any]]
  matmul: Callable[[jax.Array, Any, jax.Array], jax.Array] | None = None


_ACT_BACKENDS: dict[str, ActBackend] = {}


def register_act_backend(name: str, backend: ActBackend) -> None:
  """Registers an activation-sparsity backend under `act_sparsity.backend` = name."""
  _ACT_BACKENDS[name] = backend


def available_act_backends() -> tuple[str, ...]:
  return tuple(_ACT_BACKENDS)


def get_act_backend(name: str) -> ActBackend:
  if name not in _ACT_BACKENDS:
    raise ValueError(f"unknown act_sparsity.backend {name!r}; valid: "
                     f"{', '.join(available_act_backends())} (register others with "
                     "s24jax.nn.act_sparsity.register_act_backend)")
  return _ACT_BACKENDS[name]


# ----------------------------------------------------------------------------------------
# The op
# ----------------------------------------------------------------------------------------


@jax.custom_vjp
def apply_mask_straight_through(h: jax.Array, mask: jax.Array) -> jax.Array:
  """h where mask else 0; backward: d(h) = d(out) * mask (no gradient for the mask)."""
  return jnp.where(mask, h, jnp.zeros((), h.dtype))


def _apply_mask_fwd(h, mask):
  return apply_mask_straight_through(h, mask), mask   # save the bool mask, not h


def _apply_mask_bwd(mask, g):
  return jnp.where(mask, g, jnp.zeros((), g.dtype)), None


apply_mask_straight_through.defvjp(_apply_mask_fwd, _apply_mask_bwd)


def _rows(h: jax.Array, v: int) -> tuple[jax.Array, int]:
  """h (..., H) -> (rows padded with zeros to a multiple of v (R + pad, H), R)."""
  rows = int(np.prod(h.shape[:-1]))
  h2 = h.reshape(rows, h.shape[-1])                                   # (R, H)
  pad = -rows % v
  return (jnp.pad(h2, ((0, pad), (0, 0))) if pad else h2), rows      # (R + pad, H)


def venom_rows_mask(h: jax.Array, v: int, n: int, m: int, *,
                    backend: str = "xla") -> tuple[jax.Array, Any]:
  """V:N:M mask of h (..., H) with all leading axes as rows, padded to a multiple of v.

  Returns:
    mask: bool, h's shape.
    meta: the backend's metadata for the padded rows; for 'xla' col_idx, int32
      (ceil(rows / v), H / m, 4), the chosen columns of every block (the last block's rows
      beyond the real ones are zero padding).
  """
  if h.ndim < 1 or h.shape[-1] % m:
    raise ValueError(f"V:N:M activation sparsity needs the hidden dimension H (last axis of "
                     f"the FFN activation, shape {tuple(h.shape)}) to be a multiple of "
                     f"act_sparsity.m={m}.")
  h2, rows = _rows(jax.lax.stop_gradient(h), v)                       # (R + pad, H)
  mask, meta = get_act_backend(backend).select(h2, v, n, m)           # (R + pad, H)
  return mask[:rows].reshape(h.shape), meta


def sparsify(h: jax.Array, v: int = 64, n: int = 2, m: int = 8, *,
             backend: str = "xla") -> tuple[jax.Array, jax.Array, Any]:
  """V:N:M-sparse activation with a straight-through gradient on the kept entries.

  h (..., H): rows are all leading axes flattened (tokens), columns H.
  Returns (h_sparse, mask, meta): h_sparse = h * mask (h's shape and dtype), the bool
  mask, and the backend's metadata (see `venom_rows_mask`) for `act_matmul`.
  """
  mask, meta = venom_rows_mask(h, v, n, m, backend=backend)
  return apply_mask_straight_through(h, mask), mask, meta


def act_matmul(meta: Any, v: int, backend: str) -> Callable[[jax.Array, jax.Array],
                                                            jax.Array] | None:
  """The (x, w) -> y matmul of the second FFN layer for `sparsify`'s output; None: the
  layer's default matmul (the 'xla' reference: a dense matmul on the masked activation)."""
  fn = get_act_backend(backend).matmul
  if fn is None:
    return None

  def matmul(x, w):                                                   # x (..., H), w (out, H)
    x2, rows = _rows(x, v)                                            # (R + pad, H)
    y = fn(x2, meta, w)                                               # (R + pad, out)
    return y[:rows].reshape(*x.shape[:-1], w.shape[0])
  return matmul


register_act_backend("xla", ActBackend(select=masks.venom_select))


# ----------------------------------------------------------------------------------------
# The 'pallas' backend: kernels/venom.py (N = 2, v a power of two,
# m in {4, 8, 16}). Selection and compression in one kernel pass, the forward matmul from
# the compressed activations; backward: dense XLA matmuls (dh = dy W, dW = dy^T h_sparse).
# On CPU the kernels run in Pallas interpret mode (slow: for tests).
# ----------------------------------------------------------------------------------------


def _pallas_select(h2: jax.Array, v: int, n: int, m: int):
  if n != 2:
    raise ValueError(f"act_sparsity.backend='pallas' (kernels/venom.py) keeps 2 of the 4 "
                     f"chosen columns; got act_sparsity.n={n}.")
  values, vmeta, cols = venom.venom_compress(h2, v, m, interpret=interpret_default())
  ones = jnp.ones_like(values)
  mask = venom.venom_decompress(ones, vmeta, cols, v, m) != 0        # exact kept positions
  return mask, (values, vmeta, cols)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _pallas_matmul_op(h_sparse, w, values, vmeta, cols, v, m):
  return venom.venom_matmul(values, vmeta, cols, w.astype(values.dtype), v=v, m=m,
                            interpret=interpret_default())


def _pallas_matmul_fwd(h_sparse, w, values, vmeta, cols, v, m):
  return _pallas_matmul_op(h_sparse, w, values, vmeta, cols, v, m), (h_sparse, w)


def _pallas_matmul_bwd(v, m, res, dy):
  del v, m
  h_sparse, w = res
  dh = jnp.einsum("ro,oh->rh", dy, w.astype(dy.dtype),
                  preferred_element_type=jnp.float32).astype(h_sparse.dtype)   # (R, H)
  dw = jnp.einsum("ro,rh->oh", dy, h_sparse.astype(dy.dtype),
                  preferred_element_type=jnp.float32).astype(w.dtype)          # (out, H)
  return dh, dw, None, None, None


_pallas_matmul_op.defvjp(_pallas_matmul_fwd, _pallas_matmul_bwd)


def _pallas_matmul(h_sparse: jax.Array, meta: Any, w: jax.Array) -> jax.Array:
  values, vmeta, cols = meta
  v = h_sparse.shape[0] // cols.shape[0]
  m = h_sparse.shape[1] // cols.shape[1]
  return _pallas_matmul_op(h_sparse, w, values, vmeta, cols, v, m)


register_act_backend("pallas", ActBackend(select=_pallas_select, matmul=_pallas_matmul))


# ----------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------


def zero_fraction(h: jax.Array) -> jax.Array:
  """Fraction of entries of h that are exactly zero (float32 scalar)."""
  return jnp.mean((h == 0).astype(jnp.float32))


def kept_l1_fraction(h: jax.Array, mask: jax.Array) -> jax.Array:
  """sum |h * mask| / sum |h| (float32 scalar; 1 when h is all zeros: nothing is lost)."""
  a = jnp.abs(h).astype(jnp.float32)
  total = jnp.sum(a)
  kept = jnp.sum(jnp.where(mask, a, 0.0))
  return jnp.where(total > 0, kept / jnp.where(total > 0, total, 1.0), 1.0)


def activation_sparsity_stats(h: jax.Array, v: int, n: int, m: int,
                              mask: jax.Array | None = None) -> dict[str, jax.Array]:
  """{'zero_frac', 'kept_l1'} of h (..., H); `mask` is the V:N:M mask if already known."""
  if mask is None:
    mask = venom_rows_mask(h, v, n, m)[0]
  return {"zero_frac": zero_fraction(h), "kept_l1": kept_l1_fraction(h, mask)}
