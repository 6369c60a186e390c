"""The pure training and evaluation steps, and the fresh train state.

`train_step(state, batch)` and `eval_step(...)` are module-level, jitted functions (the model
and optimizer are static arguments); the state is donated. The step knows no method: the
model's method (s24jax/methods/) acts through its hooks. The rng of step t is
fold_in(state.rng, t) and the batch of step t is a pure function of (seed, t), so a run that
is killed and resumed reproduces an uninterrupted one step for step.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax

from s24jax import losses
from s24jax.model import GPT2
from s24jax.state import TrainState

Batch = dict[str, jax.Array]

# fold_in constant separating the sparse op's randomness (the 'sparsity' rng stream that
# SparseLinear draws its per-layer keys from) from other uses of the step rng.
_SPARSITY_STREAM = 0x6D767565


def _variables(params, sparsity):
  return {"params": params, "sparsity": sparsity} if sparsity else {"params": params}


@functools.partial(jax.jit, static_argnames=("model", "tx"), donate_argnames=("state",))
def train_step(state: TrainState, batch: Batch, *, model: GPT2,
               tx: optax.GradientTransformationExtraArgs
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step. Returns the new state and metrics (loss as a sum plus a count)."""
  method = model.config.sparsity.method
  rng = jax.random.fold_in(state.rng, state.step)
  rngs = {"sparsity": jax.random.fold_in(rng, _SPARSITY_STREAM)}

  def loss_fn(params):
    logits = model.apply(_variables(params, state.sparsity), batch["inputs"],
                         rngs=rngs)                                              # (B, T, V)
    loss_sum = losses.cross_entropy_sum(logits, batch["targets"])
    return loss_sum / batch["targets"].size, loss_sum

  (_, loss_sum), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  raw_grads, grads = grads, method.gradients(grads, state.sparsity)
  updates, opt_state = tx.update(grads, state.opt_state, state.params,
                                 **method.optimizer_args(state.params, state.sparsity))
  params = optax.apply_updates(state.params, updates)
  params, sparsity, method_metrics = method.after_update(params, state.sparsity, state.step)
  metrics = {"loss": loss_sum, "count": jnp.asarray(batch["targets"].size, jnp.float32),
             "grad_norm": optax.tree.norm(grads), **method_metrics}
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                            sparsity=sparsity)
  return method.finish_step(state, new_state, raw_grads, metrics)


@functools.partial(jax.jit, static_argnames=("model",))
def eval_step(params: Any, sparsity: Any, batch: Batch, *, model: GPT2) -> dict[str, jax.Array]:
  logits = model.apply(_variables(params, sparsity), batch["inputs"])
  return {"loss": losses.cross_entropy_sum(logits, batch["targets"]),
          "count": jnp.asarray(batch["targets"].size, jnp.float32)}


def init_state(model: GPT2, tx_fn: Callable[[Any, Any], optax.GradientTransformation],
               seed: int) -> TrainState:
  """Fresh state: params, the 'sparsity' collection (per-layer state, the method's own state
  under its name), optimizer state. `tx_fn(params, sparsity)` builds the optimizer."""
  init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
  tokens = jnp.zeros((1, model.config.seq_len), jnp.int32)
  variables = flax.core.unfreeze(model.init(init_rng, tokens))
  params = variables["params"]
  sparsity = variables.get("sparsity", {})
  method = model.config.sparsity.method
  params, sparsity = method.init_train(params, sparsity, jax.random.fold_in(init_rng, 1))
  if method.init_state():
    sparsity = {**sparsity, method.name: method.init_state()}
  tx = tx_fn(params, sparsity)
  return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params),
                    sparsity=sparsity, rng=train_rng)
