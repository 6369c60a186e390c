"""The sparse linear layer, the tied embedding / head, and their frozen `SparsityConfig`.

Every linear layer of the model is a `SparseLinear`; whether it is 2:4 sparse is decided by
matching its module path against `SparsityConfig.sparse_layers`. The kernel is stored as
W [out, in] (docs/algorithms.md, Notation) so that the 2:4 groups run along the last axis.

`linear(x, w, opts)` computes y = x W^T for both layer kinds: a sparse layer passes the
model's `GemmOptions` and goes through the three-GEMM op `sparse_ops.sparse_linear` (its
backend chosen there, by `opts.backend`), a dense one passes None and is one XLA matmul with
the autodiff backward. The V:N:M second FFN matmul replaces it by the activation backend's
own (`SparseLinear.matmul`, s24jax/nn/act_sparsity.py).

Per-layer state: a sparse layer's method state (at least its 'mask') lives in the 'sparsity'
collection; what a backend prepares from W~ for one step (`prepare`, e.g. cuSPARSELt's
compressed W~) travels apart, in the 'prepared' collection, which is never stored.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from s24jax import sparse_ops
from s24jax import state as state_lib
from s24jax.methods import base as methods_base
from s24jax.methods import registry

DENSE_FINETUNE_INITS = ("latent", "projected")
# The name (jax.ad_checkpoint.checkpoint_name) of every linear layer's output y, dense or
# sparse, in the compute dtype: the remat policy 'save_dots' (layers.REMAT_POLICIES) keeps
# it. A sparse layer's GEMMs sit inside a custom_vjp (and a cuSPARSELt call is no dot), which
# a dot-based policy cannot see; named alike, dense and sparse recipes store the same
# activations.
LINEAR_OUTPUT = "linear_output"
# The Flax collection of what `prepare` computes for one step (never checkpointed).
PREPARED = "prepared"


@dataclasses.dataclass(frozen=True)
class SparsityConfig:
  """What the sparse layers do, and the run-level sparsity settings every method shares
  (frozen and hashable: the model closes over it). Its fields other than `method` are the
  shared fields of the config block `config.sparsity` (s24jax/training/config.py generates them from
  here); `method` is there by name, with the method's own hyper-parameters in
  `config.sparsity.<name>`.
  """
  # The training method (s24jax/methods/): it projects the weights of the sparse layers.
  method: methods_base.Method = dataclasses.field(
      default_factory=lambda: registry.get_method("dense"))
  # Glob patterns over module paths ('h_3/mlp/fc'); matching linear layers are sparse. The
  # default: both FFN matrices of every block. 'wte' makes the tied embedding / head sparse.
  sparse_layers: tuple[str, ...] = ("*/mlp/*",)
  # The sparse layers' GEMMs (s24jax/sparse_ops/): 'xla' (the reference), 'pallas' (Pallas
  # kernels where they are expected to win: GPU, few tokens), 'pallas_always', 'tcgen05'
  # (Blackwell), 'cusparselt' (A100 / H100); sparse_ops.available_backends().
  backend: str = "xla"
  # Weight gradient from the unbiased MVUE 2:4 estimate of dY^T along the tokens (Hu et al.
  # 2024, S-STE); needs batch x seq_len % 4 == 0.
  mvue: bool = False
  fp8: bool = False         # FP8 GEMMs in the sparse layers (s24jax/sparse_ops/fp8.py)
  # FP8 backward GEMMs' W~ / x: 'e4m3' (as the forward), 'e5m2' (re-quantized like dY, as the
  # S-STE reference), or 'auto': the backend's choice ('e4m3' on 'xla', 'e5m2' on
  # 'cusparselt', which takes one FP8 type per GEMM); sparse_ops/options.py.
  fp8_backward_operands: str = sparse_ops.FP8_BACKWARD_AUTO
  # The last fraction of the steps trains the dense twin (s24jax/training/model_schedule.py); in [0, 1).
  dense_finetune_fraction: float = 0.0
  # Dense fine-tuning starts from the 'latent' W (the reference code: pruned weights come
  # back) or the 'projected' W~ (the sparse network itself: no loss jump at the switch).
  dense_finetune_init: str = "latent"
  # Warning (log + train/flip_rate_warning) when the global flip rate stays above this for
  # `flip_rate_warn_patience` consecutive logs; 0 turns it off (s24jax/methods/flip_monitor.py).
  flip_rate_warn: float = 0.05
  flip_rate_warn_patience: int = 5
  # Which sparse GEMMs run on the backend's 2:4 kernel (consulted by 'cusparselt';
  # s24jax/sparse_ops/gemm_choice.py): 'measured' (where measured faster than the dense XLA
  # GEMM of the same product, counting the compressions; dense where nothing was measured),
  # 'sparse' (wherever the backend can), 'dense', or a '+'-joined subset of forward, dgrad,
  # wgrad forced sparse ('forward+dgrad'), the others dense. Only the kernel changes.
  gemm_choice: str = "measured"
  # A JSON file of measured GEMM times for 'measured' (gemm_times.TABLE_FORMAT), read before
  # this machine's cache of measurements; '' for none.
  gemm_table: str = ""

  def __post_init__(self):
    if self.dense_finetune_init not in DENSE_FINETUNE_INITS:
      raise ValueError(f"unknown sparsity.dense_finetune_init {self.dense_finetune_init!r}; "
                       f"valid: {', '.join(DENSE_FINETUNE_INITS)}")
    if not 0.0 <= self.dense_finetune_fraction < 1.0:
      raise ValueError(f"sparsity.dense_finetune_fraction must be in [0, 1) (the share of "
                       f"the steps trained dense at the end), got "
                       f"{self.dense_finetune_fraction}")
    if self.flip_rate_warn < 0:
      raise ValueError(f"sparsity.flip_rate_warn must be >= 0 (0: off), got "
                       f"{self.flip_rate_warn}")
    methods_base.check_positive_int("sparsity.flip_rate_warn_patience",
                                    self.flip_rate_warn_patience)
    valid = (sparse_ops.FP8_BACKWARD_AUTO, *sparse_ops.FP8_BACKWARD_OPERANDS)
    if self.fp8_backward_operands not in valid:
      raise ValueError(f"unknown sparsity.fp8_backward_operands "
                       f"{self.fp8_backward_operands!r}; valid: {', '.join(valid)}")
    # Here, not when a step is traced: the error comes as the run's config is read.
    sparse_ops.check(self.gemm)
    if self.gemm_table:
      sparse_ops.gemm_times.load_table(self.gemm_table)
    if sparse_ops.get_backend(self.backend).needs_24 and not self.method.structured_24:
      raise ValueError(f"sparsity.backend={self.backend!r} needs 2:4 weights; method "
                       f"{self.method.name!r} is unstructured: use sparsity.backend='xla'")

  @property
  def gemm(self) -> sparse_ops.GemmOptions:
    """The options of every sparse layer's three GEMMs (the tied head's included), with
    fp8_backward_operands='auto' resolved for the backend."""
    backward = self.fp8_backward_operands
    if backward == sparse_ops.FP8_BACKWARD_AUTO:
      backward = sparse_ops.get_backend(self.backend).fp8_backward if self.fp8 else "e4m3"
    return sparse_ops.GemmOptions(mvue=self.mvue, fp8=self.fp8,
                                  fp8_backward_operands=backward,
                                  backend=self.backend, transposable=self.method.transposable,
                                  gemm_choice=self.gemm_choice, gemm_table=self.gemm_table)

  def is_sparse(self, path: str) -> bool:
    """Whether the linear layer at `path` ('h_0/mlp/fc') is sparse."""
    return self.method.sparse and any(fnmatch.fnmatchcase(path, pat)
                                      for pat in self.sparse_layers)


def linear(x: jax.Array, w: jax.Array, opts: sparse_ops.GemmOptions | None = None, *,
           key: jax.Array | None = None, prepared: dict | None = None) -> jax.Array:
  """y = x W^T for x (..., in) and W (out, in), in x's dtype with float32 accumulation.

  opts given: W is the 2:4 projected weight W~ and all three GEMMs go through
  `sparse_ops.sparse_linear` (MVUE drawn with `key`, W~ as `prepared` for the step).
  opts None: a dense XLA matmul (sparse kernels cannot run a dense weight).
  """
  if opts is not None:
    y = sparse_ops.sparse_linear(x, w, key, opts, prepared)
  else:
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype),
                   preferred_element_type=jnp.float32).astype(x.dtype)
  return checkpoint_name(y, LINEAR_OUTPUT)                              # (..., out)


def _init_layer(method: methods_base.Method, kernel: jax.Array, path: str
                ) -> dict[str, jax.Array]:
  """method.init_layer(kernel), checked (`methods_base.check_layer`), with the layer named
  in an error (e.g. a transposable mask needs `out` to be a multiple of 4 as well)."""
  try:
    return methods_base.check_layer(method, method.init_layer(kernel), kernel)
  except ValueError as e:
    raise ValueError(f"sparse layer {path!r} (kernel {tuple(kernel.shape)} = (out, in)): "
                     f"{e}") from None


def _gemm(module: nn.Module, sp: SparsityConfig) -> sparse_ops.GemmOptions:
  """The layer's GEMM options; at initialisation the 'xla' reference, whatever the backend
  (init needs shapes only, and a GPU kernel would check for its device while tracing)."""
  if module.is_initializing():
    return dataclasses.replace(sp.gemm, backend="xla")
  return sp.gemm


def _mvue_key(module: nn.Module, sp: SparsityConfig) -> jax.Array | None:
  """The layer's MVUE key for this step: per step from train_step's rngs={'mvue': ...}, per
  layer by make_rng (which folds in the module's path); None outside training."""
  return module.make_rng("mvue") if sp.mvue and module.has_rng("mvue") else None


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
  # s24jax.nn.act_sparsity.act_matmul); None: `linear` with the sparsity's GEMM options.
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
      w = sp.method.project(kernel, dict(self.variables.get("sparsity", {})))
    if self.matmul is not None:
      return self._bias(self.matmul(x.astype(self.dtype), w))            # (..., out)
    opts = _gemm(self, sp) if sparse else None
    y = linear(x.astype(self.dtype), w, opts, key=_mvue_key(self, sp) if sparse else None,
               prepared=dict(self.variables.get(PREPARED, {})))           # (..., out)
    return self._bias(y)

  def _bias(self, y: jax.Array) -> jax.Array:
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,)).astype(self.dtype)
    return y


class SparseEmbed(nn.Embed):
  """The token embedding E (vocab, C), tied with the LM head (`attend`: logits = x E^T).

  Sparse when its path ('wte') matches `sparsity.sparse_layers`: E is then the head's weight
  W (out = vocab, in = C), the method projects it like a `SparseLinear` kernel (its state in
  the 'sparsity' collection, params keep the name 'embedding'), and both uses read the same
  E~: the lookup gathers rows of E~ and the head is the sparse linear op with E~ and the
  model's GEMM options, like any sparse layer. The gradient of E sums both uses, as for any
  tied weight. Dense (the default): exactly nn.Embed.
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
    The sparse head's randomness (MVUE) is folded with the chunk index. It gets no
    `prepared` W~: `prepare` compresses for the blocks' micro-batch size, and the chunks of
    a chunked loss have another, so a backend that prepares compresses E~ in each call."""
    if not self._is_sparse():
      embedding, dtype = self.embedding, self.dtype

      def dense_head(x, chunk=None):
        del chunk
        x, table = self.promote_dtype(x, embedding, dtype=dtype)
        return jnp.dot(x, table.T)                                       # (..., vocab)
      return dense_head
    sp = self.sparsity
    table = self._table()
    key = _mvue_key(self, sp)
    opts = _gemm(self, sp)

    def sparse_head(x, chunk=None):
      k = key if key is None or chunk is None else jax.random.fold_in(key, chunk)
      return linear(x.astype(self.dtype or x.dtype), table, opts, key=k)   # (..., vocab)
    return sparse_head


class SparseHead(nn.Module):
  """An untied LM head (the Llama-style family's 'lm_head'): logits = x W^T with W
  (vocab, C), its 'kernel', stored (out, in) like every SparseLinear kernel. Sparse when its
  path matches `sparsity.sparse_layers`, like any layer (its state in the 'sparsity'
  collection), with the model's GEMM options; `head()` gives it as a pure function of
  arrays for a chunked loss, as `SparseEmbed.head` does for GPT-2's tied head."""
  features: int                     # vocab
  in_features: int                  # C
  sparsity: SparsityConfig
  dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.normal(0.02)

  def setup(self):
    self.kernel = self.param("kernel", self.kernel_init, (self.features, self.in_features))
    if self._is_sparse() and self.is_initializing():
      path = "/".join(self.path)
      for name, value in _init_layer(self.sparsity.method, self.kernel, path).items():
        self.variable("sparsity", name, lambda v=value: v)

  def _is_sparse(self) -> bool:
    return self.sparsity.is_sparse("/".join(self.path))

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.head()(x)                                                # (..., vocab)

  def head(self) -> Callable[..., jax.Array]:
    """(x (..., C), chunk=None) -> logits (..., vocab) in x's dtype; the sparse head's MVUE
    key folded with the chunk index. No `prepared` W~ (SparseEmbed.head says why)."""
    sp = self.sparsity
    if not self._is_sparse():
      kernel, dtype = self.kernel, self.dtype

      def dense_head(x, chunk=None):
        del chunk
        return linear(x.astype(dtype), kernel)                           # (..., vocab)
      return dense_head
    w = sp.method.project(self.kernel, dict(self.variables.get("sparsity", {})))
    key, opts = _mvue_key(self, sp), _gemm(self, sp)

    def sparse_head(x, chunk=None):
      k = key if key is None or chunk is None else jax.random.fold_in(key, chunk)
      return linear(x.astype(self.dtype), w, opts, key=k)                # (..., vocab)
    return sparse_head


def prepare(model_cfg, params: Any, sparsity: Any, *, tokens: int, dtype,
            micro_batches: int = 1) -> dict:
  """The 'prepared' collection of this step: for each sparse linear layer, what the backend
  prepares from its W~ (sparse_ops.Backend.prepare: e.g. cuSPARSELt's compressed W~ for
  micro-batches of `tokens` tokens per device in the compute `dtype`, shared by the step's
  `micro_batches`); {} when the backend prepares nothing. The train step calls it once per
  optimizer step, outside the accumulation loop. The tied head is left out
  (`SparseEmbed.head` says why)."""
  sp = model_cfg.sparsity
  backend = sparse_ops.get_backend(sp.backend)
  if backend.prepare is None or not sp.method.sparse or not sparsity:
    return {}
  opts = sp.gemm
  flat = {}
  for path in state_lib.sparse_layer_paths(sparsity):
    if state_lib.is_head(path):
      continue
    layer = methods_base.layer_at(sparsity, path)
    kernel = state_lib.get_path(params, path)["kernel"]

    def one(kernel, layer_state):
      w = sp.method.project(kernel, layer_state)
      return backend.prepare(w, tokens=tokens, dtype=dtype, opts=opts,
                             micro_batches=micro_batches)

    for name, value in methods_base.per_layer(one)(kernel, layer).items():
      flat[path + (name,)] = value
  return flax.traverse_util.unflatten_dict(flat)
