# %% [markdown]
# # Writing and registering a new 2:4 projection
#
# A runnable notebook in Jupytext "percent" format: open it in Jupyter (with jupytext) or VS Code
# as a notebook, or run it as a script:
#
#     python experiments/new_projection.py            # the full tiny run (a few minutes on CPU)
#     python experiments/new_projection.py --steps 20 # a quick look
#
# We define a projection that the library does not ship, register it by name, and train the
# tiny GPT-2 with it exactly as with a built-in one (`--config.sparsity.projection=NAME`).
#
# The example: **scaled STE**. The hard 2:4 threshold loses half of each group's weights, so the
# layer's output shrinks; scale the kept weights by a per-tensor beta = <W, m*W> / <m*W, m*W>
# computed once at initialisation (the S-STE idea, with the hard threshold), with the plain
# straight-through backward.

# %%
import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from s24jax import compare, loop, masks, projections  # noqa: E402


# %% [markdown]
# The forward/backward pair is an ordinary `jax.custom_vjp`. Its state (beta) is an argument,
# so it lives in the train state: it is checkpointed and restored with everything else.

# %%
@jax.custom_vjp
def scaled_ste24(w, scale):
  return scale * jnp.where(masks.nm_mask(w), w, 0)


def _fwd(w, scale):
  return scaled_ste24(w, scale), scale


def _bwd(scale, g):
  return g, jnp.zeros_like(scale)   # straight through, not multiplied by the scale


scaled_ste24.defvjp(_fwd, _bwd)


def init_scale(w):
  kept = jnp.where(masks.nm_mask(w), w, 0)
  return {"scale": jnp.vdot(w, kept) / jnp.vdot(kept, kept)}


# %% [markdown]
# Register it. A `Projection` bundles the forward (`apply(w, state, cfg)`), the state it needs
# (`init_state(w)`) and its mask (for the flip rate and masked decay). A stateless projection
# can be registered as a plain function `w -> w_tilde` instead.

# %%
projections.register_projection("scaled_ste", projections.Projection(
    name="scaled_ste",
    apply=lambda w, state, cfg: scaled_ste24(w, state["scale"]),
    init_state=init_scale,
    mask=masks.nm_mask,
), overwrite=True)
print(projections.available_projections())

# %% [markdown]
# Train with it by name, like any built-in projection.

# %%
def main(steps=None, workdir="runs/notebook_scaled_ste"):
  overrides = {"sparsity.projection": "scaled_ste"}
  if steps:
    overrides.update({"total_steps": steps, "eval_every": steps, "log_every": max(1, steps // 10)})
  config = compare.load_config(
      os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_s_ste.py:tiny"), overrides)
  final = loop.train_and_evaluate(config, workdir)
  print({k: round(v, 4) for k, v in final.items() if isinstance(v, float)})
  return final


if __name__ == "__main__" and "ipykernel" not in sys.modules:
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--workdir", default="runs/notebook_scaled_ste")
  args = parser.parse_args()
  main(args.steps, args.workdir)
