"""Pure N:M sparsity math: masks, flip rate, the MVUE 2:4 estimator. No autodiff rules here.

Convention (docs/algorithms.md, Notation): W is [out, in]; y = x W^T contracts over `in`, so the
groups of M consecutive entries run along the *last* axis. Every function is vectorised and
jit-friendly: shapes and the small combinatorial tables (the 90 transposable patterns, the
column subsets of VENOM) are static, so nothing loops over data at trace or run time.

Public names (used by notebooks, docs and outside checks): `nm_mask`, `transposable_mask`, `flip_rate`, `mvue24`,
`venom_mask`. The other public helpers (`transposable_kept_ratio`, `mvue24_inclusion_prob`,
`mvue24_variance`, `venom_select`, `TRANSPOSABLE_PATTERNS`) exist for reporting, kernels and
tests.

The 2:4 projections (`nm_mask`, `soft_threshold24`, `mvue24`) work on a group's members as
separate arrays, elementwise (no sort, reduction or stack over a group of four), so that
XLA:GPU fuses them with the cuSPARSELt compression that follows (kernels/cusparselt/
traffic.py: deviceless H100 compiles; never run on a GPU). Their results are bit for bit those
of the sort / reduction versions they replaced (checked on CPU), except `mvue24` on a group
holding a NaN, which is now all NaN (XLA:CPU's vectorised max had skipped the NaN at some
shapes and not at others).
"""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

# ----------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------


def check_groupable(x: jax.Array, m: int, what: str = "last axis") -> None:
  """Raises a ValueError that names the offending dimension when it is not a multiple of m."""
  if x.ndim < 1 or x.shape[-1] % m:
    raise ValueError(
        f"N:M sparsity needs the {what} to be a multiple of {m}; got shape {tuple(x.shape)} "
        f"(dimension {x.shape[-1] if x.ndim else None} is not divisible by {m}).")


def _members(g: jax.Array) -> list[jax.Array]:
  """The m members of every group (last axis of g (..., G, m)) as m arrays (..., G)."""
  return [g[..., i] for i in range(g.shape[-1])]


def _stack_last(parts: list[jax.Array]) -> jax.Array:
  """jnp.stack(parts, -1), written as zero pads ORed together (on the bits of floats: exact).

  Why: XLA:GPU fuses a stack (a concatenate) poorly and, in front of a compression that reads
  the members back, wrote the stacked array out; pads are elementwise, so the members' math
  fuses into whatever consumes the result (s24jax/perf/compression_traffic.py)."""
  dtype = parts[0].dtype
  as_bits = jnp.issubdtype(dtype, jnp.floating)
  bits = jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}") if as_bits else dtype
  m, out = len(parts), None
  for i, part in enumerate(parts):
    v = jax.lax.bitcast_convert_type(part, bits) if as_bits else part
    v = jax.lax.pad(v[..., None], jnp.zeros((), bits), [(0, 0, 0)] * v.ndim + [(i, m - 1 - i, 0)])
    out = v if out is None else out | v
  return jax.lax.bitcast_convert_type(out, dtype) if as_bits else out


def _ranks_desc(members: list[jax.Array]) -> list[jax.Array]:
  """Descending rank of every member within its group, ties to the lower index (int32).

  rank_j = number of members i that beat member j: larger, or equal with a lower index
  (i < j: a_i >= a_j; i > j: a_i > a_j). Pairwise comparisons instead of a sort: groups are
  tiny (m = 4 or 8), the tie rule is explicit, so exactly n members have rank < n, and the
  ranks are elementwise in the members, which XLA fuses into their consumer.
  """
  ranks = []
  for j, mj in enumerate(members):
    beats = [(mi >= mj) if i < j else (mi > mj) for i, mi in enumerate(members) if i != j]
    ranks.append(sum((b.astype(jnp.int32) for b in beats), jnp.zeros(mj.shape, jnp.int32)))
  return ranks


# ----------------------------------------------------------------------------------------
# Hard-threshold N:M mask and flip rate
# ----------------------------------------------------------------------------------------


def nm_mask(w: jax.Array, n: int = 2, m: int = 4) -> jax.Array:
  """Bool mask keeping the n largest |w| in every group of m along the last axis.

  Ties go to the lower index (a stable ranking), so exactly n entries are kept per group,
  which is what a compressed N:M storage format needs: a fixed count per group.
  """
  if not 0 <= n <= m:
    raise ValueError(f"nm_mask needs 0 <= n <= m; got n={n}, m={m}.")
  check_groupable(w, m)
  g = jnp.abs(w).reshape(*w.shape[:-1], w.shape[-1] // m, m)   # (..., K/m, m)
  keep = [r < n for r in _ranks_desc(_members(g))]               # m x (..., K/m)
  return _stack_last(keep).reshape(w.shape)                      # (..., K)


def soft_threshold24(w: jax.Array) -> jax.Array:
  """S-STE's soft threshold S(w) per group of 4 along the last axis, in w's dtype: t = the
  second-smallest |w_i| of the group, S(w)_i = sign(w_i) max(|w_i| - t, 0). The two largest
  entries survive, shrunk by t; S is continuous in w (the hard threshold jumps when two
  magnitudes cross, this does not). The one implementation: the S-STE method and the fused
  kernel's reference (sparsify24.soft_threshold24_reference) both call it."""
  check_groupable(w, 4)
  g = w.reshape(*w.shape[:-1], w.shape[-1] // 4, 4)              # (..., K/4, 4)
  a = jnp.abs(g)
  t = _second_smallest(_members(a))[..., None]                     # (..., K/4, 1)
  s = jnp.sign(g) * jnp.maximum(a - t, 0)
  return s.reshape(w.shape)                                        # (..., K)


def _second_smallest(mags: list[jax.Array]) -> jax.Array:
  """The second smallest of four magnitudes (|x|, sign bit clear), exactly as jnp.sort orders
  them: a min/max network on their bits, whose integer order is that of the magnitudes with
  NaN above +inf (sort puts NaNs last). Elementwise, so XLA fuses it where a sort over a
  size-4 axis is a kernel of its own."""
  bits = jnp.dtype(f"int{8 * jnp.dtype(mags[0].dtype).itemsize}")
  b = [jax.lax.bitcast_convert_type(v, bits) for v in mags]
  low = jnp.maximum(jnp.minimum(b[0], b[1]), jnp.minimum(b[2], b[3]))
  high = jnp.minimum(jnp.maximum(b[0], b[1]), jnp.maximum(b[2], b[3]))
  return jax.lax.bitcast_convert_type(jnp.minimum(low, high), mags[0].dtype)


def flip_rate(mask_new: jax.Array, mask_old: jax.Array) -> jax.Array:
  """Fraction of entries whose mask bit changed between two steps (docs/algorithms.md, Flip rate: r_t)."""
  return jnp.mean((mask_new != mask_old).astype(jnp.float32))


# ----------------------------------------------------------------------------------------
# Transposable 2:4 mask ("mask by convolution", Hu et al. 2024)
# ----------------------------------------------------------------------------------------


@functools.cache
def _transposable_patterns_np() -> np.ndarray:
  """The 90 binary 4x4 patterns with exactly two ones in every row and every column.

  Order (it decides ties, so it is part of the behaviour): each row picks a pair of columns
  from `itertools.combinations(range(4), 2)` = (0,1),(0,2),(0,3),(1,2),(1,3),(2,3); the
  patterns are `itertools.product` of those choices for rows 0..3 (row 0 varies slowest),
  keeping those whose column sums are all 2. Pattern 0 is therefore rows (0,1),(0,1),(2,3),(2,3).
  """
  pairs = list(itertools.combinations(range(4), 2))
  rows = np.zeros((len(pairs), 4), np.int8)                      # (6, 4)
  for k, (i, j) in enumerate(pairs):
    rows[k, [i, j]] = 1
  choice = np.array(list(itertools.product(range(len(pairs)), repeat=4)))  # (1296, 4)
  pats = rows[choice]                                            # (1296, 4, 4)
  pats = pats[(pats.sum(axis=1) == 2).all(axis=1)]               # (90, 4, 4)
  assert pats.shape == (90, 4, 4), pats.shape
  pats.setflags(write=False)
  return pats


TRANSPOSABLE_PATTERNS: np.ndarray = _transposable_patterns_np()  # (90, 4, 4) int8, read-only


def _check_transposable(w: jax.Array) -> None:
  """Both of the last two axes must split into 4x4 blocks; name the one that does not."""
  if w.ndim < 2:
    raise ValueError(
        f"transposable_mask needs an array with at least 2 dimensions (..., R, C); got shape "
        f"{tuple(w.shape)}.")
  for axis, name in ((-2, "rows R"), (-1, "columns C")):
    if w.shape[axis] % 4:
      raise ValueError(
          f"transposable_mask needs the {name} (axis {axis}) to be a multiple of 4; got shape "
          f"{tuple(w.shape)} (dimension {w.shape[axis]} is not divisible by 4).")


@jax.named_scope("transposable_mask")   # its kernels, by name in the compiled HLO (step_census)
def transposable_mask(w: jax.Array) -> jax.Array:
  """Bool mask that is 2:4 along both of the last two axes of w (..., R, C).

  Why: the backward GEMM dX = dY W~ contracts over `out`, so it runs on sparse tensor cores
  only if W~ is also 2:4 along `out`, i.e. the mask of W^T is 2:4 too.

  For every 4x4 block B of |w| it picks, among the 90 doubly-2:4 patterns P, the one that
  maximises sum(P * B). All scores of all blocks are one matmul [90, 16] x [16, blocks]
  followed by an argmax over the 90 ("mask by convolution", Hu et al. 2024: a stride-4
  convolution with 90 filters). Ties go to the lowest pattern index in the order documented
  in `_transposable_patterns_np` (argmax returns the first maximum). Scores are computed in
  float32 at HIGHEST precision so a GPU does not round them through TF32.
  """
  _check_transposable(w)
  *lead, r, c = w.shape
  a = jnp.abs(w).astype(jnp.float32)
  blocks = a.reshape(*lead, r // 4, 4, c // 4, 4)                # (..., R/4, 4, C/4, 4)
  blocks = jnp.swapaxes(blocks, -3, -2)                          # (..., R/4, C/4, 4, 4)
  flat = blocks.reshape(-1, 16)                                  # (NB, 16)
  pats = jnp.asarray(TRANSPOSABLE_PATTERNS.reshape(90, 16), jnp.float32)  # (90, 16)
  scores = jnp.matmul(pats, flat.T, precision=jax.lax.Precision.HIGHEST)  # (90, NB)
  best = jnp.argmax(scores, axis=0)                              # (NB,)
  chosen = jnp.asarray(TRANSPOSABLE_PATTERNS, jnp.bool_)[best]   # (NB, 4, 4)
  chosen = chosen.reshape(*lead, r // 4, c // 4, 4, 4)           # (..., R/4, C/4, 4, 4)
  return jnp.swapaxes(chosen, -3, -2).reshape(w.shape)           # (..., R, C)


def transposable_kept_ratio(w: jax.Array) -> jax.Array:
  """Kept |w| mass of `transposable_mask` over that of the row-wise 2:4 `nm_mask` (<= 1).

  The price of transposability, for reporting: the row-wise mask is the unconstrained
  optimum per group, so the ratio is at most 1. Returns 1 for an all-zero w (no mass lost).
  """
  a = jnp.abs(w).astype(jnp.float32)
  kept_t = jnp.sum(jnp.where(transposable_mask(w), a, 0.0))
  kept_r = jnp.sum(jnp.where(nm_mask(w), a, 0.0))
  return jnp.where(kept_r > 0, kept_t / jnp.where(kept_r > 0, kept_r, 1.0), 1.0)


# ----------------------------------------------------------------------------------------
# MVUE 2:4 estimator (unbiased, stochastic)
# ----------------------------------------------------------------------------------------

# Relative eps: a_i = |x_i| + MVUE_REL_EPS * max_j |x_j| + tiny, per group of four.
# Any eps > 0 keeps the estimator exactly unbiased for every x: every p_i > 0, so each entry
# is kept with positive probability and E[keep_i * x_i / p_i] = p_i * x_i / p_i = x_i. (Zero
# entries may be drawn; they are then kept as 0 / p_i = 0, so an all-zero group yields zeros.)
# Making eps relative to the group max keeps the estimator scale invariant (MVUE(c x) has the
# law of c MVUE(x)), so tiny gradients are not sampled near-uniformly as an absolute eps
# would force, while 1e-6 keeps p_i >= ~2.5e-7 and |x_i / p_i| <= S (see `mvue24`). The
# `tiny` (smallest normal float32) only matters for all-zero or denormal groups, where it
# makes the draw uniform (p_i = 1/2) instead of 0/0.
MVUE_REL_EPS = 1e-6
MVUE_TINY = float(np.finfo(np.float32).tiny)


def _mvue24_weights(x: jax.Array) -> list[jax.Array]:
  """a_i = |x_i| + eps per group of four, float32: four arrays (..., K/4), one per member."""
  check_groupable(x, 4)
  g = jnp.abs(x.astype(jnp.float32)).reshape(*x.shape[:-1], x.shape[-1] // 4, 4)  # (..., K/4, 4)
  c = _members(g)                                                # 4 x (..., K/4)
  top = jnp.maximum(jnp.maximum(c[0], c[1]), jnp.maximum(c[2], c[3]))   # exact, as a max is
  eps = MVUE_REL_EPS * top + MVUE_TINY
  return [ci + eps for ci in c]


def _inclusion_prob_grouped(c: list[jax.Array]) -> list[jax.Array]:
  """p_i = a_i/S + sum_{j != i} (a_j/S) a_i/(S - a_j) for the weights a_i of four arrays."""

  def others(v, i):   # sum over j != i, added explicitly (see below)
    rest = [v[j] for j in range(4) if j != i]
    return (rest[0] + rest[1]) + rest[2]

  # Every sum is over the other three terms, never "total minus own term": when one a_j
  # dominates (e.g. [1, 0, 0, 0]) a subtraction would cancel catastrophically in float32 and
  # cost ~1e-5 of p_i. Per member (no masked (G, 4, 4) reduction, no stack), so that XLA
  # fuses it into one elementwise loop (18x faster on CPU, where MVUE was most of a step)
  # with the draw and whatever consumes the estimate.
  s = ((c[0] + c[1]) + c[2]) + c[3]                              # (..., G)
  q = [ci / s for ci in c]                                       # first-draw probabilities
  t = [q[j] / others(c, j) for j in range(4)]                    # q_j / (S - a_j)
  return [q[i] + c[i] * others(t, i) for i in range(4)]          # 4 x (..., G)


def mvue24_inclusion_prob(x: jax.Array) -> jax.Array:
  """Probability p_i that `mvue24` keeps entry i (float32, same shape as x); sums to 2 per group."""
  p = _inclusion_prob_grouped(_mvue24_weights(x))                # 4 x (..., K/4)
  return _stack_last(p).reshape(x.shape)


def mvue24_variance(x: jax.Array) -> jax.Array:
  """Exact per-entry variance of `mvue24(key, x)`: x_i^2 (1/p_i - 1) (float32, x's shape)."""
  p = mvue24_inclusion_prob(x)
  xf = x.astype(jnp.float32)
  return xf * xf * (1.0 / p - 1.0)


@jax.named_scope("mvue")   # its kernels, by name in the compiled HLO (step_census)
def mvue24(key: jax.Array, x: jax.Array) -> jax.Array:
  """Unbiased stochastic 2:4 estimate of x along the last axis: E[mvue24(key, x)] = x.

  Why: the weight gradient dW = dY^T x contracts over tokens; making dY^T 2:4 along tokens
  with an *unbiased* estimator lets that GEMM run sparse without biasing SGD (S-STE, Hu et al.).

  Per group of four, with a_i = |x_i| + eps (see MVUE_REL_EPS) and S = sum a_i: draw a first
  index with probability a_i/S, then a second from the remaining three with probability
  proportional to a_j; keep the two drawn entries as x_i / p_i with p_i the inclusion
  probability (`mvue24_inclusion_prob`), zero the rest. Sampling uses the Gumbel top-2 trick:
  the two largest of log a_i + Gumbel_i (ties: lower index; Gumbel_i of group g is
  jax.random.gumbel(key, (..., K/4, 4))[..., g, i]) are distributed exactly as that successive
  draw without replacement. Exactly two positions are drawn per group; an output can still have
  fewer non-zeros when a drawn x_i is 0. Since |x_i| <= a_i and p_i >= a_i/S, every kept value
  is bounded by S (no overflow, also in bfloat16).

  Args:
    key: a jax PRNG key.
    x: (..., K), K a multiple of 4, float32 or bfloat16.

  Returns:
    Array of x's shape and dtype (computed in float32), at most two non-zeros per group.
  """
  a = _mvue24_weights(x)                                         # 4 x (..., K/4)
  p = _inclusion_prob_grouped(a)                                 # 4 x (..., K/4)
  gumbel = jax.random.gumbel(key, (*x.shape[:-1], x.shape[-1] // 4, 4), jnp.float32)
  keep = [r < 2 for r in _ranks_desc([jnp.log(ai) + gi for ai, gi in zip(a, _members(gumbel))])]
  xg = _members(x.astype(jnp.float32).reshape(gumbel.shape))     # 4 x (..., K/4)
  out = [jnp.where(k, xi / pi, 0.0).astype(x.dtype) for k, xi, pi in zip(keep, xg, p)]
  return _stack_last(out).reshape(x.shape)


# ----------------------------------------------------------------------------------------
# V:N:M (VENOM) mask
# ----------------------------------------------------------------------------------------


_VENOM_SUBSET_BATCH = 5


@functools.cache
def _column_subsets_np(m: int) -> np.ndarray:
  """All C(m, 4) sorted 4-subsets of range(m), lexicographic (itertools) order: (S, 4) int32."""
  subs = np.array(list(itertools.combinations(range(m), 4)), np.int32)
  subs.setflags(write=False)
  return subs


def _top_n_sum4(cols: list[jax.Array], n: int) -> jax.Array:
  """Sum of the n largest of four same-shaped non-negative arrays, elementwise.

  Max over the C(4, n) <= 6 n-subsets of their sums: pure elementwise max/add that XLA fuses
  into one loop, instead of a sort along a size-4 axis (a separate, unfused op).
  """
  if n == 0:
    return jnp.zeros_like(cols[0])
  best = None
  for combo in itertools.combinations(range(4), n):   # static, <= 6 terms
    s = functools.reduce(jnp.add, [cols[k] for k in combo])
    best = s if best is None else jnp.maximum(best, s)
  return best


def _check_venom(x: jax.Array, v: int, n: int, m: int) -> None:
  """Raises a ValueError naming the bad argument or the dimension that does not split."""
  if v < 1:
    raise ValueError(f"venom_mask needs v >= 1; got v={v}.")
  if m < 4:
    raise ValueError(f"venom_mask chooses 4 columns per block, so it needs m >= 4; got m={m}.")
  if not 0 <= n <= 4:
    raise ValueError(f"venom_mask keeps n of the 4 chosen columns, so 0 <= n <= 4; got n={n}.")
  if x.ndim < 2:
    raise ValueError(
        f"venom_mask needs an array with at least 2 dimensions (..., R, C); got shape "
        f"{tuple(x.shape)}.")
  if x.shape[-2] % v:
    raise ValueError(
        f"venom_mask needs the rows R (axis -2) to be a multiple of v={v}; got shape "
        f"{tuple(x.shape)} (dimension {x.shape[-2]} is not divisible by {v}).")
  if x.shape[-1] % m:
    raise ValueError(
        f"venom_mask needs the columns C (axis -1) to be a multiple of m={m}; got shape "
        f"{tuple(x.shape)} (dimension {x.shape[-1]} is not divisible by {m}).")


def venom_select(x: jax.Array, v: int, n: int = 2, m: int = 8) -> tuple[jax.Array, jax.Array]:
  """V:N:M mask plus the chosen columns: the metadata a VENOM kernel needs.

  x (..., R, C) is split into blocks of v rows (axis -2) by m columns (axis -1, the
  contraction axis). In each block 4 columns are chosen, shared by the v rows, and inside
  them every row keeps its n largest |x| (plain n:4 on the condensed v x 4 block). The 4
  columns maximise the kept magnitude of that final mask *exactly*: every one of the C(m, 4)
  subsets (70 for m = 8) is scored as sum over rows of the row's top-n |x| within the subset,
  and the argmax wins (ties: lowest subset index, itertools.combinations order). Per-column
  sums would be cheaper but are not the optimum once rows disagree.

  Returns:
    mask: bool, x's shape; n non-zeros per row in every block (density n/m).
    col_idx: int32 (..., R/v, C/m, 4), the chosen columns of every block, sorted, in [0, m).
  """
  _check_venom(x, v, n, m)
  *lead, r, c = x.shape
  a = jnp.abs(x).astype(jnp.float32)
  blk = a.reshape(*lead, r // v, v, c // m, m)                   # (..., R/v, v, C/m, m)
  blk = jnp.swapaxes(blk, -3, -2)                                # (..., R/v, C/m, v, m)
  subs = jnp.asarray(_column_subsets_np(m))                      # (S, 4)

  def subset_score(sub):                                         # sub: (4,) one subset
    cols = [jnp.take(blk, sub[k], axis=-1) for k in range(4)]    # 4 x (..., R/v, C/m, v)
    return _top_n_sum4(cols, n).sum(axis=-1)                     # (..., R/v, C/m)

  # A few subsets at a time: all 70 at once would materialise ~35x the input (measured on
  # XLA:CPU, the gathers do not fuse into the row reduction); batches of 5 keep it ~3-4x and
  # were also the fastest on CPU.
  score = jax.lax.map(subset_score, subs,
                      batch_size=min(_VENOM_SUBSET_BATCH, subs.shape[0]))  # (S, ..., R/v, C/m)
  best = jnp.argmax(score, axis=0)                               # (..., R/v, C/m)
  col_idx = subs[best]                                           # (..., R/v, C/m, 4)
  cond = jnp.take_along_axis(blk, col_idx[..., None, :], axis=-1)  # (..., R/v, C/m, v, 4)
  keep = _stack_last([r < n for r in _ranks_desc(_members(cond))])  # (..., R/v, C/m, v, 4)
  onehot = col_idx[..., None, :, None] == jnp.arange(m)          # (..., R/v, C/m, 1, 4, m)
  mask = jnp.any(onehot & keep[..., None], axis=-2)              # (..., R/v, C/m, v, m)
  mask = jnp.swapaxes(mask, -3, -2).reshape(x.shape)             # (..., R, C)
  return mask, col_idx.astype(jnp.int32)


def venom_mask(x: jax.Array, v: int, n: int = 2, m: int = 8) -> jax.Array:
  """Bool V:N:M mask of x (..., R, C): row blocks of v along axis -2; see `venom_select`."""
  return venom_select(x, v, n, m)[0]
