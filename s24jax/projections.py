"""2:4 projections W -> S(W) as `jax.custom_vjp` functions, and their registry.

A projection turns the dense latent weight W ([out, in], groups of 4 along `in`) into the
weight the forward pass uses. Its backward rule is what distinguishes the methods
(DESIGN.md section 4). Each projection is a `Projection`:

  apply(w, state, cfg) -> w~   the custom_vjp projection; `state` is the per-tensor sparsity
                               state (e.g. the S-STE scale beta), a dict of arrays; `cfg`
                               the frozen `SparsityConfig` (hyper-parameters)
  init_state(w) -> state       computed once from the initial weight, kept in the train state
                               (so it is checkpointed and restored unchanged)
  mask(w) -> bool mask         the support of apply(w, state) (for flip rate and masked decay)
  update_state(w, state, step, cfg) -> state
                               optional: called after every optimizer step with the new
                               weight and the new step count (e.g. to recompute the S-STE
                               scale every k steps); None keeps the state as initialised

A notebook adds one with `register_projection(name, fn)`, where `fn` is either a
`Projection` or a plain `fn(w) -> w_tilde` (usually itself a custom_vjp); training with it
is then `--config.sparsity.projection=name`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from s24jax import masks

State = Mapping[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Projection:
  """A named 2:4 projection: forward map with its backward rule, state and mask."""
  name: str
  apply: Callable[[jax.Array, State, Any], jax.Array]
  init_state: Callable[[jax.Array], dict[str, jax.Array]] = lambda w: {}
  mask: Callable[[jax.Array], jax.Array] = masks.nm_mask
  # True when apply(w) is dense (no 2:4 constraint, no mask to monitor).
  is_dense: bool = False
  update_state: Callable[[jax.Array, State, jax.Array, Any], dict[str, jax.Array]] | None = None
  # True when the mask is train state (state['mask'], dynamic sparse training, s24jax/mst.py)
  # rather than a function of W: `mask(w)` is then only the initial mask, train_step keeps
  # state['mask'] as it is and feeds only the active entries' gradients to the optimizer.
  mask_in_state: bool = False
  # True when the forward reads a cached mask state['mask'] that train_step recomputes with
  # `mask(w)` only every `sparsity.mask_refresh_every` optimizer steps (t_sr_ste: the
  # transposable mask, Hu et al. 2024); in between the forward keeps the cached mask.
  mask_refresh: bool = False
  # True when the method takes SR-STE's masked decay lambda_W (1 - m) W in the optimizer
  # (placements 'gradients' / 'weights', s24jax/optim.py) on its mask state['mask'].
  masked_decay: bool = False
  doc: str = ""


# ---------------------------------------------------------------------------------------------
# dense: identity.


def _dense_apply(w, state, cfg):
  del state, cfg
  return w


# ---------------------------------------------------------------------------------------------
# ste: hard threshold forward, identity backward.


@jax.custom_vjp
def ste24(w: jax.Array) -> jax.Array:
  """Hard-threshold 2:4 with the straight-through estimator.

  Forward: W~ = m(W) * W, m keeps the two largest |w| of every 4 along the last axis.
  Backward: dL/dW := dL/dW~ (identity; pruned weights get the gradient too, which is what
  lets the mask change).
  """
  return jnp.where(masks.nm_mask(w), w, 0)


def _ste24_fwd(w):
  return ste24(w), None


def _ste24_bwd(_, g):
  return (g,)


ste24.defvjp(_ste24_fwd, _ste24_bwd)

# ---------------------------------------------------------------------------------------------
# sr_ste: hard threshold forward, STE + masked decay backward.


@jax.custom_vjp
def sr_ste24(w: jax.Array, decay: jax.Array) -> jax.Array:
  """SR-STE (Zhou et al. 2021) with the masked decay inside the backward pass.

  Forward: W~ = m(W) * W. Backward: dL/dW := dL/dW~ + decay * (1 - m(W)) * W.
  This is the SGD form of SR-STE. With Adam, Hu et al. 2024 move the decay term out of the
  backward, into the optimizer (`s24jax.optim`); `sparsity.decay_placement` picks where,
  and `decay` is 0 here unless the placement is 'backward'. `decay` is a hyper-parameter
  (possibly chosen during warm-up, so an array): its cotangent is zero.
  """
  return jnp.where(masks.nm_mask(w), w, 0)


def _sr_ste24_fwd(w, decay):
  m = masks.nm_mask(w)
  return jnp.where(m, w, 0), (w, m, decay)


def _sr_ste24_bwd(res, g):
  w, m, decay = res
  dw = g + (decay * jnp.where(m, 0, w)).astype(g.dtype)
  return dw, jnp.zeros_like(decay)


sr_ste24.defvjp(_sr_ste24_fwd, _sr_ste24_bwd)


# ---------------------------------------------------------------------------------------------
# s_ste: continuous soft threshold with a fixed per-tensor scale.


def soft_threshold24(w: jax.Array) -> jax.Array:
  """S-STE soft threshold S(w) per group of 4 along the last axis.

  t = the second-smallest |w_i| of the group; S(w)_i = sign(w_i) * max(|w_i| - t, 0).
  The two largest entries survive, shrunk by t; S is continuous in w (the hard threshold
  jumps when two magnitudes cross, this does not).
  """
  masks._check_groupable(w, 4)  # pylint: disable=protected-access
  g = w.reshape(*w.shape[:-1], w.shape[-1] // 4, 4)            # (..., K/4, 4)
  a = jnp.abs(g)
  t = jnp.sort(a, axis=-1)[..., 1:2]                             # (..., K/4, 1)
  s = jnp.sign(g) * jnp.maximum(a - t, 0)
  return s.reshape(w.shape)


def s_ste_scale(w: jax.Array) -> jax.Array:
  """beta = <w, S(w)> / <S(w), S(w)>: the least-squares scale of S(w) towards w.

  Computed once at initialisation and then frozen (recomputing it every step makes it
  grow, Hu, Zhu, Chen 2024). Returns a float32 scalar; 1.0 when S(w) is all zeros.
  """
  w32 = w.astype(jnp.float32)
  s = soft_threshold24(w32)
  num = jnp.vdot(w32, s)
  den = jnp.vdot(s, s)
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 1.0)


def s_ste_update_state(w: jax.Array, state: State, step: jax.Array, cfg) -> dict[str, jax.Array]:
  """Recomputes beta = s_ste_scale(w) when `step` is a multiple of cfg.rescale_every.

  `step` is the number of optimizer steps taken (1 after the first update), so with
  rescale_every=k beta is recomputed from W_k, W_2k, ... and is fixed in between.
  rescale_every=0 (the S-STE recipe) never recomputes: beta stays its initial value.
  This is the ablation of the paper: a recomputed beta grows during training.
  """
  k = getattr(cfg, "rescale_every", 0)
  if not k:
    return dict(state)
  scale = jax.lax.cond(step % k == 0, lambda: s_ste_scale(w),
                       lambda: jnp.asarray(state["scale"], jnp.float32))
  return {**state, "scale": scale}


@jax.custom_vjp
def s_ste24(w: jax.Array, scale: jax.Array) -> jax.Array:
  """S-STE forward beta * S(w); straight-through backward dL/dW := dL/d(beta S(w)).

  The gradient is *not* multiplied by beta (or by dS/dw): it passes straight through, as
  in the S-STE paper. `scale` is frozen state, so its cotangent is zero.
  """
  return (scale * soft_threshold24(w)).astype(w.dtype)


def _s_ste24_fwd(w, scale):
  return s_ste24(w, scale), scale


def _s_ste24_bwd(scale, g):
  return g, jnp.zeros_like(scale)


s_ste24.defvjp(_s_ste24_fwd, _s_ste24_bwd)


# ---------------------------------------------------------------------------------------------
# mst: unstructured mask kept in the state (Mixed Sparsity Training, dynamic sparse training).


@jax.custom_vjp
def masked_dense_grad(w: jax.Array, mask: jax.Array) -> jax.Array:
  """Forward W~ = mask * W (any unstructured bool mask); backward dL/dW := dL/dW~, dense.

  The dense gradient reaches the pruned entries too: MST grows connections where |dL/dW~|
  is largest. train_step then keeps only the active entries' gradients (so pruned weights
  stay exactly 0 under Adam); the topology update (s24jax/mst.py) reads the dense one.
  """
  return jnp.where(mask, w, 0)


def _masked_dense_grad_fwd(w, mask):
  return masked_dense_grad(w, mask), None


def _masked_dense_grad_bwd(_, g):
  return g, None   # the mask is a bool input: no cotangent


masked_dense_grad.defvjp(_masked_dense_grad_fwd, _masked_dense_grad_bwd)


# ---------------------------------------------------------------------------------------------
# t_sr_ste: cached transposable mask, STE + masked decay (Hu et al. 2024).


@jax.custom_vjp
def masked_ste24(w: jax.Array, mask: jax.Array, decay: jax.Array) -> jax.Array:
  """Forward W~ = mask * W with a given (cached) 2:4 mask; backward STE + masked decay.

  Backward: dL/dW := dL/dW~ + decay * (1 - mask) * W. `decay` is 0 unless
  sparsity.decay_placement is 'backward' (Hu et al. put it on the gradients, in the
  optimizer). The mask is a bool input and `decay` a hyper-parameter: no cotangents.
  With the transposable mask (`masks.transposable_mask`) W~ is 2:4 along both `in` and
  `out`, so the data-gradient GEMM dX = dY W~ of `sparse_ops` is 2:4 sparse too.
  """
  return jnp.where(mask, w, 0)


def _masked_ste24_fwd(w, mask, decay):
  return masked_ste24(w, mask, decay), (w, mask, decay)


def _masked_ste24_bwd(res, g):
  w, mask, decay = res
  return g + (decay * jnp.where(mask, 0, w)).astype(g.dtype), None, jnp.zeros_like(decay)


masked_ste24.defvjp(_masked_ste24_fwd, _masked_ste24_bwd)


def _t_sr_ste_apply(w, state, cfg):
  decay = state.get("decay", cfg.decay) if cfg.decay_placement == "backward" else 0.0
  return masked_ste24(w, state["mask"], jnp.asarray(decay, jnp.float32))


# ---------------------------------------------------------------------------------------------
# Registry.

_REGISTRY: dict[str, Projection] = {}


def register_projection(name: str, fn: Projection | Callable[[jax.Array], jax.Array], *,
                        overwrite: bool = False) -> Projection:
  """Registers a projection under `name` so configs can select it by name.

  `fn` is a `Projection`, or a plain function w -> w_tilde (stateless; its mask is taken
  to be the support of its output). Re-registering a name needs overwrite=True, so a
  typo in a notebook cannot silently replace a built-in.
  """
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"projection {name!r} is already registered; pass overwrite=True "
                     "to replace it.")
  if isinstance(fn, Projection):
    proj = dataclasses.replace(fn, name=name)
  elif callable(fn):
    plain = fn
    proj = Projection(
        name=name,
        apply=lambda w, state, cfg: plain(w),
        mask=lambda w: plain(jax.lax.stop_gradient(w)) != 0,
        doc=(plain.__doc__ or "").strip())
  else:
    raise TypeError(f"register_projection needs a Projection or a callable, got {fn!r}")
  _REGISTRY[name] = proj
  return proj


def available_projections() -> tuple[str, ...]:
  """The registered projection names, sorted."""
  return tuple(sorted(_REGISTRY))


def get_projection(name: str) -> Projection:
  """The projection registered as `name`; an unknown name lists the valid ones."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"unknown projection {name!r}; valid projections: "
                     f"{', '.join(available_projections())}") from None


def _sr_ste_apply(w, state, cfg):
  decay = state.get("decay", cfg.decay) if cfg.decay_placement == "backward" else 0.0
  return sr_ste24(w, jnp.asarray(decay, jnp.float32))


register_projection("dense", Projection(
    "dense", _dense_apply, mask=lambda w: jnp.ones(w.shape, bool), is_dense=True,
    doc="No sparsity: W~ = W."))
register_projection("ste", Projection(
    "ste", lambda w, state, cfg: ste24(w), doc=ste24.__doc__))
register_projection("sr_ste", Projection("sr_ste", _sr_ste_apply, masked_decay=True,
                                          doc=sr_ste24.__doc__))
# Hu et al. 2024: transposable mask ("by convolution"), cached in state['mask'] and refreshed
# every sparsity.mask_refresh_every steps; SR-STE masked decay on that mask.
register_projection("t_sr_ste", Projection(
    "t_sr_ste", _t_sr_ste_apply, mask=masks.transposable_mask, mask_refresh=True,
    masked_decay=True, doc=masked_ste24.__doc__))
register_projection("s_ste", Projection(
    "s_ste", lambda w, state, cfg: s_ste24(w, state["scale"]),
    init_state=lambda w: {"scale": s_ste_scale(w)}, update_state=s_ste_update_state,
    doc=s_ste24.__doc__))
# MST: the live mask is state['mask'] (set by s24jax.mst's topology updates); training starts
# dense (the warm-up phase prunes from there), so the initial mask is all ones.
register_projection("mst", Projection(
    "mst", lambda w, state, cfg: masked_dense_grad(w, state["mask"]),
    mask=lambda w: jnp.ones(w.shape, bool), mask_in_state=True, doc=masked_dense_grad.__doc__))
