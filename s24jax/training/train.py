"""The pure training and evaluation steps, and the fresh train state.

`train_step(state, batch)` and `eval_step(...)` are module-level, jitted functions (the model
and optimizer are static arguments); the state is donated. The step knows no method: the
model's method (s24jax/methods/) acts through its hooks, with the loop's `StepInfo` of the
step. The rng of step t is fold_in(state.rng, t) and the batch of step t is a pure function of
(seed, t), so a run that is killed and resumed reproduces an uninterrupted one step for step.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax

from s24jax.training import sharding
from s24jax.methods.base import layer_scalars
from s24jax.nn import model as model_lib
from s24jax.nn import sparse_linear
from s24jax.sparse_ops import gemm_choice
from s24jax.state import TrainState
from s24jax.step_info import StepInfo

Batch = dict[str, jax.Array]

# fold_in constant separating the sparse op's randomness (the 'mvue' rng stream that
# SparseLinear draws its per-layer keys from) from other uses of the step rng.
_MVUE_STREAM = 0x6D767565


def _variables(params, sparsity, prepared=None):
  """The model's variables: params, the per-layer method state, the step's prepared W~."""
  out = {"params": params}
  if sparsity:
    out["sparsity"] = sparsity
  if prepared:
    out[sparse_linear.PREPARED] = prepared
  return out


def _micro_batches(batch: Batch, k: int) -> Batch:
  """(B, ...) -> (k, B / k, ...): micro-batch i holds rows i, i + k, i + 2k, ..., so each one
  keeps the batch's split over the devices (rows are sharded in contiguous blocks)."""
  return jax.tree.map(
      lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), batch)


def loss_and_grads(params: Any, sparsity: Any, batch: Batch, key: jax.Array, *, model: Any,
                   accum_steps: int = 1) -> tuple[jax.Array, Any]:
  """(summed token loss, gradient of the mean token loss) over the whole batch.

  With accum_steps = k > 1 the batch is split into k micro-batches inside a lax.scan that
  sums their gradients: the same math as one big batch (each micro-batch's summed loss is
  divided by the whole batch's token count), with the activations of one micro-batch alive
  at a time. Micro-batch i draws its sparse-op randomness (MVUE) from fold_in(key, i).
  Weights that a backend multiplies in compressed form are compressed once here, before the
  micro-batches (`sparse_linear.prepare`), not in each of them.
  """
  tokens = batch["targets"].size
  mesh = jax.sharding.get_abstract_mesh()
  devices = 1 if mesh.empty else mesh.size
  prepared = sparse_linear.prepare(model.config, params, sparsity,
                                   tokens=tokens // accum_steps // devices,
                                   dtype=model_lib.compute_dtype(model.config.dtype),
                                   micro_batches=accum_steps)

  def grads_of(b, k):
    def loss_fn(p):
      loss_sum = model.apply(_variables(p, sparsity, prepared), b["inputs"], b["targets"],
                             rngs={"mvue": k})
      return loss_sum / tokens, loss_sum
    (_, loss_sum), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss_sum, grads

  if accum_steps == 1:
    return grads_of(batch, key)

  def body(carry, xs):
    loss_sum, grads = grads_of(*xs)
    return jax.tree.map(jnp.add, carry, (loss_sum, grads)), None

  zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(accum_steps))
  (loss_sum, grads), _ = jax.lax.scan(body, zero, (_micro_batches(batch, accum_steps), keys))
  return loss_sum, grads


@functools.partial(jax.jit, static_argnames=("model", "tx", "accum_steps", "partitioner"),
                   donate_argnames=("state",))
def train_step(state: TrainState, batch: Batch, info: StepInfo | None = None, *, model: Any,
               tx: optax.GradientTransformationExtraArgs, accum_steps: int = 1,
               partitioner: sharding.Partitioner | None = None
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step (of `accum_steps` micro-batches). `info` is the loop's StepInfo of
  the step (None: the step of state.step, its metrics read). Returns the new state and
  metrics (loss as a sum plus a count; `finite`: loss and gradient norm are finite)."""
  method = model.config.sparsity.method
  if info is None:
    info = StepInfo(step=state.step, log=True)
  key = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), _MVUE_STREAM)
  # The mesh as context while tracing: ops that must place work per device themselves (an
  # opaque custom call, e.g. sparse_ops' cusparselt backend) read it.
  mesh = (jax.sharding.use_abstract_mesh(partitioner.mesh.abstract_mesh)
          if partitioner is not None else contextlib.nullcontext())
  with mesh:
    loss_sum, grads = loss_and_grads(state.params, state.sparsity, batch, key, model=model,
                                     accum_steps=accum_steps)
  updates, opt_state = tx.update(grads, state.opt_state, state.params, method=method,
                                 sparsity=state.sparsity, method_state=state.method_state)
  after = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                        opt_state=opt_state)
  new_state, method_metrics = method.update(state, after, grads, info)
  grad_norm = optax.tree.norm(grads)
  metrics = {"loss": loss_sum, "count": jnp.asarray(batch["targets"].size, jnp.float32),
             "grad_norm": grad_norm, "finite": jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm),
             **method_metrics}
  if method.sparse:   # scalar layer state, e.g. the S-STE scale, as it leaves the step
    metrics.update(layer_scalars(new_state.sparsity))
  if partitioner is not None:
    new_state = partitioner.constrain(new_state)
  return new_state, metrics


@functools.partial(jax.jit, static_argnames=("model",))
def eval_step(params: Any, sparsity: Any, batch: Batch, *, model: Any) -> dict[str, jax.Array]:
  # No backward here: the sparse GEMMs' choice looks up and measures the forward's only.
  with gemm_choice.forward_only():
    return {"loss": model.apply(_variables(params, sparsity), batch["inputs"],
                                batch["targets"]),
            "count": jnp.asarray(batch["targets"].size, jnp.float32)}


def fresh_state(model: Any, tx_fn: Callable[[Any, Any], optax.GradientTransformation],
                seed: int) -> TrainState:
  """A new run's state: params, the 'sparsity' collection (per-layer state), the method's own
  state, the optimizer state. `tx_fn(params, sparsity)` builds the optimizer."""
  init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
  tokens = jnp.zeros((1, model.config.seq_len), jnp.int32)
  variables = flax.core.unfreeze(model.init(init_rng, tokens))
  method = model.config.sparsity.method
  params, sparsity, method_state = method.init_state(variables["params"],
                                               variables.get("sparsity", {}),
                                               jax.random.fold_in(init_rng, 1))
  tx = tx_fn(params, sparsity)
  return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params),
                    sparsity=sparsity, method_state=method_state, rng=train_rng)
