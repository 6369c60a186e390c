"""The straight-through estimator every hard-mask method shares (jaxpruner's `SteMixin`).

    forward   W~ = mask * W
    backward  dL/dW := dL/dW~ + decay * (1 - mask) * W

The mask is the method's: STE and SR-STE pass the hard 2:4 mask of W (`masks.nm_mask`),
T-SR-STE its cached transposable mask, MST its unstructured mask from the state. The decay is
SR-STE's masked decay in its 'backward' placement (Zhou et al. 2021, the SGD form); 0 for
every other method and placement. Pruned weights get the gradient too: that is what lets a
mask change (docs/algorithms.md, "STE").

`decay` is static (a hyper-parameter of the method, a Python float): with 0 the backward is
the plain identity, with no extra work. The mask is a bool input: no cotangent.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def masked(w: jax.Array, mask: jax.Array, decay: float = 0.0) -> jax.Array:
  """mask * W, straight through (module docstring); w (..., out, in), mask like w."""
  return jnp.where(mask, w, 0)


def _fwd(w, mask, decay):
  # The latent W is needed only for the decay term.
  return masked(w, mask, decay), (w if decay else None, mask)


def _bwd(decay, res, g):
  w, mask = res
  if not decay:
    return g, None
  return g + (decay * jnp.where(mask, 0, w)).astype(g.dtype), None


masked.defvjp(_fwd, _bwd)
