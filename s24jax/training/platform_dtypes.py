"""Which compute dtypes this process's backend can train with: found before a run starts.

A float dtype can be valid and still not compute here: `jax.nn.dot_product_attention` asks
for an explicit dot algorithm in half precision (F16_F16_F32 for float16, BF16_BF16_F32 for
bfloat16: half-precision operands, float32 accumulation), and XLA:CPU refuses F16_F16_F32
(jax 0.10.2: "The precision 'F16_F16_F32' is not supported by dot_general on CPU"), which a
run would meet at its first step, after writing its config and checkpoint 0. `problem`
lowers (no compile, no run) the gradient of causal attention followed by a dot with float32
results, in the dtype, for the device the step is built for (kernels._common.target_device,
as the attention choice asks: a step put on the CPU of a GPU host is checked for the CPU),
once per process, platform and dtype: what the model's step needs of the dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from s24jax import errors
from s24jax.nn import layers
from s24jax.kernels import _common

FLOATS = ("float32", "bfloat16", "float16")


@functools.lru_cache(maxsize=None)
def problem(dtype: str, platform: str) -> str | None:
  """None if the target device (of `platform`, the cache key) lowers the step's dots in
  `dtype`; else the first line of its error."""
  del platform
  dt = jnp.dtype(dtype)
  q = jax.ShapeDtypeStruct((1, 8, 1, 8), dt)   # (B, T, N, hd)
  w = jax.ShapeDtypeStruct((8, 8), dt)

  def loss(q, w):
    y = jax.nn.dot_product_attention(q, q, q, is_causal=True)                   # (B, T, N, hd)
    return jnp.sum(jnp.einsum("btnh,hk->btnk", y, w, preferred_element_type=jnp.float32))

  try:
    with jax.default_device(_common.target_device()):
      jax.jit(jax.grad(loss, argnums=(0, 1))).lower(q, w)
  except Exception as e:  # pylint: disable=broad-except  (any refusal: the dtype cannot run)
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
  return None


def working(platform: str | None = None) -> list[str]:
  """The float dtypes the target device can train with."""
  platform = platform or _common.target_device().platform
  return [d for d in FLOATS if problem(d, platform) is None]


def check(name: str, field: str = "config.model.dtype") -> None:
  """A UserError unless the dtype `name` ('auto' resolved as the model resolves it) is one the
  target device can train with; `field`: the setting the message names (a command's flag)."""
  dtype = jnp.dtype(layers.compute_dtype(name)).name
  platform = _common.target_device().platform
  why = problem(dtype, platform) if dtype != "float32" else None
  if why:
    raise errors.UserError(f"{field}={name!r}: the {platform} device cannot train "
                           f"in {dtype} ({why}); dtypes that work here: "
                           f"{', '.join(working(platform))} ('auto' picks one)")
