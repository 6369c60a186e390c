"""The sparse linear layer and the one matmul dispatch point.

Every linear layer of the model is a `SparseLinear`; whether it is 2:4 sparse is decided by
matching its module path against `SparsityConfig.sparse_layers`. The kernel is stored as
W [out, in] (docs/algorithms.md, Notation) so that the 2:4 groups run along the last axis.

`linear(x, w_tilde, backend=..., sparse=...)` is the single place where y = x W~^T is
computed. Sparse layers go through the three-GEMM op `sparse_ops.sparse_linear` (forward,
data gradient and weight gradient all 2:4 sparse, MVUE optional); its `xla` backend is the
reference and faster backends plug in there (`sparsity.backend='pallas'`: kernels/ where they
are expected to win, `'pallas_always'`: everywhere; cuSPARSELt later). Dense layers are one
XLA matmul with the autodiff backward.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from s24jax.methods import base as methods_base
from s24jax.methods import registry
from s24jax import sparse_ops
from s24jax import state as state_lib

BACKENDS = sparse_ops.BACKENDS
DENSE_FINETUNE_INITS = ("latent", "projected")


@dataclasses.dataclass(frozen=True)
class SparsityConfig:
  """What the sparse layers do (frozen and hashable: the model closes over it).

  `method` (s24jax/methods/) projects the weights; the other fields configure the three-GEMM
  op of every sparse layer and compose with any 2:4 method.
  """
  method: methods_base.Method = dataclasses.field(
      default_factory=lambda: registry.get_method("dense"))
  # Glob patterns over module paths ('h_3/mlp/fc'); matching linear layers are sparse.
  sparse_layers: tuple[str, ...] = ("*/mlp/*",)
  backend: str = "xla"      # the GEMMs: 'xla' (reference), 'pallas', 'pallas_always'
  mvue: bool = False        # weight gradient from the MVUE 2:4 estimate of dY^T
  fp8: bool = False         # FP8 GEMMs (s24jax/fp8.py)
  # FP8 format of W~ and x in the backward GEMMs (sparse_ops.FP8_BACKWARD_OPERANDS).
  fp8_backward_operands: str = "e4m3"
  # How dense fine-tuning starts (s24jax/phases.py: enter): 'latent' W or 'projected' W~.
  dense_finetune_init: str = "latent"

  def __post_init__(self):
    if self.dense_finetune_init not in DENSE_FINETUNE_INITS:
      raise ValueError(f"unknown sparsity.dense_finetune_init {self.dense_finetune_init!r}; "
                       f"valid: {', '.join(DENSE_FINETUNE_INITS)}")
    if self.backend not in BACKENDS:
      raise ValueError(f"unknown sparsity.backend {self.backend!r}; valid: "
                       f"{', '.join(BACKENDS)}")
    # Here too, not only in sparse_ops.GemmOptions: the error then comes when the run's
    # config is read, not when the first step is traced.
    sparse_ops.check_fp8_backward_operands(self.fp8_backward_operands, fp8=self.fp8,
                                           backend=self.backend)
    if self.backend != "xla" and not self.method.structured_24:
      raise ValueError(f"sparsity.backend={self.backend!r} needs 2:4 weights; method "
                       f"{self.method.name!r} is unstructured: use sparsity.backend='xla'")

  def is_sparse(self, path: str) -> bool:
    """Whether the linear layer at `path` ('h_0/mlp/fc') is sparse."""
    return self.method.sparse and any(fnmatch.fnmatchcase(path, pat)
                                      for pat in self.sparse_layers)


def linear(x: jax.Array, w: jax.Array, *, backend: str = "xla", sparse: bool = False,
           key: jax.Array | None = None, mvue: bool = False, fp8: bool = False,
           fp8_backward_operands: str = "e4m3", transposable: bool = False,
           prepared: dict | None = None) -> jax.Array:
  """y = x W^T for x (..., in) and W (out, in), in x's dtype with float32 accumulation.

  sparse=True: W is the 2:4 projected weight W~ and all three GEMMs go through
  `sparse_ops.sparse_linear` on `backend` (with the MVUE weight gradient if `mvue`, drawn
  with `key`; FP8 GEMMs if `fp8`, W~ and x in `fp8_backward_operands` in the backward
  ones). sparse=False: a dense XLA matmul whatever the backend
  (sparse kernels cannot run a dense weight).
  """
  if backend not in BACKENDS:
    raise ValueError(f"unknown sparsity.backend {backend!r}; valid: {', '.join(BACKENDS)}")
  if sparse:
    return sparse_ops.sparse_linear(x, w, key, mvue=mvue, backend=backend, fp8=fp8,
                                    fp8_backward_operands=fp8_backward_operands,
                                    transposable=transposable, prepared=prepared)
  return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype),
                    preferred_element_type=jnp.float32).astype(x.dtype)


def _init_layer(method: methods_base.Method, kernel: jax.Array, path: str
                ) -> dict[str, jax.Array]:
  """method.init_layer(kernel), with the layer named in a shape error (e.g. a transposable
  mask needs `out` to be a multiple of 4 as well)."""
  try:
    return method.init_layer(kernel)
  except ValueError as e:
    raise ValueError(f"sparse layer {path!r} (kernel {tuple(kernel.shape)} = (out, in)): "
                     f"{e}") from None


class SparseLinear(nn.Module):
  """y = x S(W)^T + b with W (features, in); S the configured method's projection if sparse.

  Sparse layers keep their state (e.g. the S-STE scale, the mask of the last step) in the
  'sparsity' collection, next to 'params', so it is sharded and checkpointed with the rest of
  the train state.
  """
  features: int
  sparsity: SparsityConfig
  use_bias: bool = True
  dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.normal(0.02)
  # (x, w) -> y replacing `linear` (e.g. a V:N:M sparse-activation kernel from
  # s24jax.act_sparsity.act_matmul); None: `linear` with sparsity.backend.
  matmul: Callable | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    in_features = x.shape[-1]
    kernel = self.param("kernel", self.kernel_init, (self.features, in_features))  # (out, in)
    path = "/".join(self.path)
    w = kernel
    sp = self.sparsity
    sparse = sp.is_sparse(path)
    if sparse:
      if in_features % 4:
        raise ValueError(f"sparse layer {path!r}: its input dimension (in_features) is "
                         f"{in_features}, not a multiple of 4, so it cannot be 2:4 sparse "
                         "along the contraction axis.")
      if self.is_initializing():
        for name, value in _init_layer(sp.method, kernel, path).items():
          self.variable("sparsity", name, lambda v=value: v)
      layer = dict(self.variables.get("sparsity", {}))
      w = sp.method.project(kernel, layer)
    if self.matmul is not None:
      y = self.matmul(x.astype(self.dtype), w)                           # (..., out)
    else:
      # Randomness of the sparse op (MVUE): per step from train_step's rngs={'sparsity': ...},
      # per layer by make_rng (which folds in this module's path); None outside training.
      key = (self.make_rng("sparsity") if sparse and sp.mvue and self.has_rng("sparsity")
             else None)
      # Initialisation only needs shapes: the reference backend (no kernels at init).
      backend = "xla" if self.is_initializing() else sp.backend
      # W~ compressed once for the step (`prepare`), when the train step did so.
      prepared = ({k: v for k, v in layer.items() if k in sparse_ops.PREPARED}
                  if sparse else None)
      y = linear(x.astype(self.dtype), w, backend=backend, sparse=sparse, key=key,
                 mvue=sp.mvue, fp8=sp.fp8, fp8_backward_operands=sp.fp8_backward_operands,
                 transposable=sp.method.transposable,
                 prepared=prepared)                                      # (..., out)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,)).astype(self.dtype)
    return y


class SparseEmbed(nn.Embed):
  """The token embedding E (vocab, C), tied with the LM head (`attend`: logits = x E^T).

  Sparse when its path ('wte') matches `sparsity.sparse_layers`: E is then the head's weight
  W (out = vocab, in = C), the method projects it like a `SparseLinear` kernel (its state in
  the 'sparsity' collection, params keep the name 'embedding'), and both uses read the same
  E~: the lookup gathers rows of E~ and the head is the sparse linear op with E~. The
  gradient of E sums both uses, as for any tied weight. Dense (the default): exactly
  nn.Embed.
  """
  sparsity: SparsityConfig = SparsityConfig()

  def _is_sparse(self) -> bool:
    return self.sparsity.is_sparse("/".join(self.path))

  def setup(self):
    super().setup()
    if self._is_sparse() and self.is_initializing():
      path = "/".join(self.path)
      for name, value in _init_layer(self.sparsity.method, self.embedding, path).items():
        self.variable("sparsity", name, lambda v=value: v)

  def _table(self) -> jax.Array:
    """E~ (vocab, C): the method's projection of the table."""
    return self.sparsity.method.project(self.embedding,
                                        dict(self.variables.get("sparsity", {})))

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if not self._is_sparse():
      return super().__call__(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    (table,) = self.promote_dtype(self._table(), dtype=self.dtype, inexact=False)
    return jnp.take(table, inputs, axis=0)                               # (..., C)

  def attend(self, query: jax.Array) -> jax.Array:
    return self.head()(query)

  def head(self) -> Callable[..., jax.Array]:
    """The head as a pure function of arrays, (x (..., C), chunk=None) -> logits (..., vocab),
    so a chunked loss can call it inside lax.scan / jax.checkpoint (no module calls there).
    The sparse head's randomness (MVUE) is folded with the chunk index."""
    if not self._is_sparse():
      embedding, dtype = self.embedding, self.dtype

      def dense_head(x, chunk=None):
        del chunk
        x, table = self.promote_dtype(x, embedding, dtype=dtype)
        return jnp.dot(x, table.T)                                       # (..., vocab)
      return dense_head
    sp = self.sparsity
    table = self._table()
    key = self.make_rng("sparsity") if sp.mvue and self.has_rng("sparsity") else None

    def sparse_head(x, chunk=None):
      k = key if key is None or chunk is None else jax.random.fold_in(key, chunk)
      return linear(x.astype(self.dtype or x.dtype), table, backend=sp.backend, sparse=True,
                    key=k, mvue=sp.mvue, fp8=sp.fp8,
                    fp8_backward_operands=sp.fp8_backward_operands)      # (..., vocab)
    return sparse_head


def prepare(model_cfg, params: Any, sparsity: Any, *, tokens: int, dtype) -> Any:
  """The sparsity collection with each sparse linear layer's W~ compressed for this step's
  micro-batches of `tokens` tokens per device in the compute `dtype`
  (sparse_ops.prepare_weights), when the backend
  multiplies compressed weights ('cusparselt'); unchanged otherwise. The train step calls it
  once per optimizer step, outside the accumulation loop; the tied head (whose chunks differ
  in size) compresses in its own call."""
  sp = model_cfg.sparsity
  if sp.backend != "cusparselt" or not sp.method.sparse or not sparsity:
    return sparsity
  opts = sparse_ops.GemmOptions(mvue=sp.mvue, backend=sp.backend, fp8=sp.fp8,
                                fp8_backward_operands=sp.fp8_backward_operands,
                                transposable=sp.method.transposable)
  out = flax.core.unfreeze(jax.tree.map(lambda x: x, sparsity))
  for path in state_lib.sparse_layer_paths(sparsity):
    if path == (state_lib.HEAD,):
      continue
    layer = state_lib.get_path(out, path)
    kernel = state_lib.get_path(params, path)["kernel"]

    def one(kernel, layer_state):
      w = sp.method.project(kernel, layer_state)
      return sparse_ops.prepare_weights(w, tokens=tokens, dtype=dtype, opts=opts)

    layer.update(methods_base.per_layer(one)(kernel, dict(layer)))
  return out
