"""The fully sparse linear op: all three GEMMs of a linear layer 2:4 sparse (Hu et al. 2024).

(Over 400 lines on purpose: one op and its backends, each a custom_vjp of the same three
GEMMs sharing `GemmOptions`, the MVUE operand and the dense fallbacks; split apart, the rules
of one op would be read across five files.)

For y = x W~^T with x (N, in) tokens and W~ (out, in) the projected weight (docs/algorithms.md):

  forward   y  = x W~^T          W~ is 2:4 along `in`                  (_fwd_gemm)
  data grad dX = dY W~           W~ is 2:4 along `out` too when its mask is transposable
                                 (`projections` 't_sr_ste'), so this GEMM is sparse as well
                                                                      (_dgrad_gemm)
  weight    dW~ = MVUE(dY^T) x   dY^T (out, N) made 2:4 along the tokens by the unbiased
  grad                           estimator `masks.mvue24` when `mvue` is on; plain dY^T x
                                 otherwise                            (_wgrad_gemm)

The op is a `jax.custom_vjp` over (x, w_tilde, key): it sits *after* the projection
W -> W~ (whose own backward rule, e.g. straight-through plus masked decay, maps dW~ to dW)
and before nothing else, so projections and GEMMs stay independent. The bias is added by
the caller and its gradient stays dense.

Extending it: every GEMM is a small named helper taking the static `GemmOptions`, so a fast
backend (a Pallas kernel on compressed values + metadata, cuSPARSELt) or low-precision
operands (FP8) change one helper and add one option field; the `xla` backend below is the
reference every other backend is tested against. With `backend='xla'` the GEMMs are dense
matmuls on the masked matrices (mathematically the sparse product; no speed-up).

Backends (`sparsity.backend`, chosen per call in `uses_pallas_kernels`, the one place):
  'xla'            the reference above.
  'pallas'         the Pallas kernels (kernels/) where `compressed_matmul.should_use_pallas_matmul`
                   expects them to win (a GPU, few tokens: the memory-bound regime), 'xla'
                   elsewhere. On CPU that is always 'xla'.
  'pallas_always'  the Pallas kernels for every sparse layer (equivalence tests, benchmarks).
  'tcgen05'        Blackwell (sm_100a) only: forward y^T = W~ x^T, data gradient
                   dX^T = W~^T dY^T (transposable masks; dense otherwise) and, with MVUE, the
                   weight gradient MVUE(dY^T) x on 2:4 sparse tensor cores (kernels/tcgen05.py).
                   Compiled for a B200, never run (no Blackwell GPU here).
  'cusparselt'     A100, H100 and newer: cuSPARSELt through the XLA FFI
                   (kernels/cusparselt/): forward, data gradient (transposable masks; dense
                   otherwise) and, with MVUE, the weight gradient on the 2:4 sparse tensor
                   cores; FP8 (e4m3 / e5m2, per-tensor scales as in 'xla') with sparsity.fp8
                   (not sparsity.fp8_backward_operands='e5m2': no e5m2 x e5m2 FP8 GEMM).
                   Under a mesh each device runs its own shard (shard_map). Compiled for
                   A100 and H100 without a GPU; its CPU tests use the jnp stand-in of
                   kernels/cusparselt/ops.py.
The Pallas path (`_pallas_linear_2d`) compresses W~ once per call (`sparsify24.compress24`),
runs the forward (`compressed_matmul.sparse24_matmul`) and dX = dY W~ (`sparse24_matmul_dx`) on the
compressed operand, and keeps the weight gradient the dense dY^T x (or its MVUE version)
from `_wgrad_gemm`: the kernel's own dvalues exist only at kept positions, and
straight-through projections need dL/dW~ at the pruned ones too. It assumes W~ is 2:4 along
`in` (every built-in 2:4 projection; `mst`'s unstructured masks are refused in
s24jax/mst.py): compress24 keeps the two largest |W~| per group. Off a GPU the kernels run in
Pallas interpret mode (slow, exact: CPU tests exercise the same code). FP8 is xla-only.

The key: MVUE needs randomness in the backward pass. The caller passes a PRNG key per layer
and per step (`SparseLinear` draws it with `make_rng('sparsity')` from the `rngs={'sparsity': ...}`
that `train.train_step` derives from fold_in(state.rng, step)). A key of None is fine for a
forward-only call; differentiating with mvue on and no key raises.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from s24jax import fp8 as fp8_lib
from s24jax.kernels import _common
from s24jax.kernels import compressed_matmul
from s24jax.kernels import mvue24
from s24jax.kernels import sparsify24
from s24jax.kernels import masks
from s24jax.kernels import tcgen05
from s24jax.kernels.cusparselt import ops as cusparselt

# See "Backends" above; sparsity.backend must be one of these.
BACKENDS = ("xla", "pallas", "pallas_always", "tcgen05", "cusparselt")
# sparsity.fp8_backward_operands: the FP8 format of W~ (dX = dY W~) and x (dW = est(dY^T) x)
# in the backward GEMMs. 'e4m3' (default): as in the forward, so every FP8 GEMM has an e4m3
# operand (what FP8 tensor cores take). 'e5m2': re-quantized like dY (the S-STE reference).
FP8_BACKWARD_OPERANDS = ("e4m3", "e5m2")


def check_fp8_backward_operands(value: str, *, fp8: bool, backend: str) -> None:
  """Raises ValueError unless `value` is a valid sparsity.fp8_backward_operands for a
  layer with these sparsity.fp8 and sparsity.backend settings."""
  if value not in FP8_BACKWARD_OPERANDS:
    raise ValueError(f"unknown sparsity.fp8_backward_operands {value!r}; valid: "
                     f"{', '.join(FP8_BACKWARD_OPERANDS)}")
  if value == "e4m3":
    return
  # Not a silent no-op: asking for e5m2 backward operands means an FP8 run was intended.
  if not fp8:
    raise ValueError(f"sparsity.fp8_backward_operands={value!r} sets a format of the FP8 "
                     "backward GEMMs, but sparsity.fp8 is False: set sparsity.fp8=True, or "
                     "leave it at 'e4m3'.")
  if backend == "cusparselt":
    raise ValueError(f"sparsity.fp8_backward_operands={value!r} is not supported by "
                     "sparsity.backend='cusparselt': dY, W~ and x would all be e5m2, and an "
                     "FP8 tensor-core GEMM (cuSPARSELt's, on Hopper) needs one e4m3 operand; "
                     "e5m2 x e5m2 has none. Use 'e4m3' with 'cusparselt', or "
                     "sparsity.backend='xla'.")


@dataclasses.dataclass(frozen=True)
class GemmOptions:
  """Static options of the three GEMMs (hashable: a non-differentiable custom_vjp argument)."""
  mvue: bool = False        # weight gradient from the MVUE 2:4 estimate of dY^T
  fp8: bool = False         # FP8 GEMMs (s24jax/fp8.py): e4m3 x and W~, e5m2 dY
  # FP8 format of W~ and x in the two backward GEMMs (FP8_BACKWARD_OPERANDS).
  fp8_backward_operands: str = "e4m3"
  backend: str = "xla"      # GEMM implementation; 'xla' is the reference
  # W~ is 2:4 along `out` too (a transposable mask, Method.transposable): the data-gradient
  # GEMM may then run sparse ('tcgen05'); otherwise it is dense.
  transposable: bool = False
  # Set by `_per_device` inside shard_map: the mesh axes the tokens are split over, so that
  # FP8's per-tensor amax is the whole tensor's (a pmax over them), as on the 'xla' backend.
  token_axes: tuple[str, ...] = ()

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"unknown sparsity.backend {self.backend!r}; valid: "
                       f"{', '.join(BACKENDS)}")
    if self.fp8 and self.backend not in ("xla", "cusparselt"):
      raise ValueError(f"sparsity.fp8 needs sparsity.backend='xla' or 'cusparselt' (the "
                       f"Pallas kernels have no FP8 path); got backend {self.backend!r}.")
    check_fp8_backward_operands(self.fp8_backward_operands, fp8=self.fp8,
                                backend=self.backend)


def _matmul_f32(a: jax.Array, b: jax.Array, dims) -> jax.Array:
  """dot_general with float32 accumulation (bf16 operands on GPU, float32 on CPU)."""
  return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _fp8_matmul_f32(a: jax.Array, b: jax.Array, dims, a_format, b_format) -> jax.Array:
  """FP8 path of `_matmul_f32` (opts.fp8): a in `a_format` (e4m3 forward operand, e5m2
  gradient), b (x or W~) in `b_format`, per-tensor amax scales, fp32 result."""
  return fp8_lib.fp8_dot_general(a, b, (dims, ((), ())), a_dtype=a_format,
                                 b_dtype=b_format, out_dtype=jnp.float32)


def _fp8_backward_format(opts: GemmOptions):
  """The float8 dtype of W~ / x in the backward GEMMs (opts.fp8_backward_operands)."""
  return fp8_lib.FORMATS[opts.fp8_backward_operands]


def _fwd_gemm(x: jax.Array, w: jax.Array, opts: GemmOptions) -> jax.Array:
  """y = x W~^T: x (N, in), W~ (out, in) 2:4 along `in` -> (N, out) float32."""
  if opts.fp8:
    return _fp8_matmul_f32(x, w, ((1,), (1,)), fp8_lib.E4M3, fp8_lib.E4M3)   # (N, out)
  return _matmul_f32(x, w, ((1,), (1,)))                         # (N, out)


def _dgrad_gemm(dy: jax.Array, w: jax.Array, opts: GemmOptions) -> jax.Array:
  """dX = dY W~: dY (N, out), W~ (out, in) 2:4 along `out` if transposable -> (N, in) f32."""
  if opts.fp8:   # W~ quantized afresh in the backward format (e4m3: as the forward did)
    return _fp8_matmul_f32(dy, w, ((1,), (0,)), fp8_lib.E5M2,
                           _fp8_backward_format(opts))          # (N, in)
  return _matmul_f32(dy, w, ((1,), (0,)))                        # (N, in)


def _wgrad_operand(dy: jax.Array, key: jax.Array | None, opts: GemmOptions) -> jax.Array:
  """dY^T (out, N), 2:4 along the tokens (MVUE) when opts.mvue; exact otherwise."""
  dy_t = dy.T                                                    # (out, N)
  if not opts.mvue:
    return dy_t
  if key is None:
    raise ValueError("the sparse linear op has sparsity.mvue=True but got no PRNG key: "
                     "apply the model with rngs={'sparsity': key} when taking gradients "
                     "(train.train_step does).")
  n = dy_t.shape[-1]
  if n % 4:
    raise ValueError(f"MVUE makes dY^T 2:4 along the tokens, so the number of tokens per "
                     f"step (batch x sequence length, here {n}) must be a multiple of 4.")
  return masks.mvue24(key, dy_t)                                 # (out, N)


def _wgrad_gemm(dy: jax.Array, x: jax.Array, key: jax.Array | None,
                opts: GemmOptions) -> jax.Array:
  """dW~ = est(dY^T) x: dY (N, out), x (N, in) -> (out, in) float32."""
  dy_t = _wgrad_operand(dy, key, opts)                           # (out, N)
  if opts.fp8:   # quantizes the (MVUE-)estimate itself: the GEMM's actual operand
    return _fp8_matmul_f32(dy_t, x, ((1,), (0,)), fp8_lib.E5M2,
                           _fp8_backward_format(opts))          # (out, in)
  return _matmul_f32(dy_t, x, ((1,), (0,)))                      # (out, in)


# opts (argument 0) is static configuration, not an array.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sparse_linear_2d(opts: GemmOptions, x: jax.Array, w: jax.Array,
                      key: jax.Array | None) -> jax.Array:
  return _fwd_gemm(x, w.astype(x.dtype), opts).astype(x.dtype)


def _sparse_linear_2d_fwd(opts, x, w, key):
  return _sparse_linear_2d(opts, x, w, key), (x, w, key)


def _sparse_linear_2d_bwd(opts, res, dy):
  x, w, key = res
  dx = _dgrad_gemm(dy, w.astype(dy.dtype), opts).astype(x.dtype)    # (N, in)
  dw = _wgrad_gemm(dy, x.astype(dy.dtype), key, opts).astype(w.dtype)  # (out, in)
  dkey = None if key is None else np.zeros(key.shape, jax.dtypes.float0)
  return dx, dw, dkey


_sparse_linear_2d.defvjp(_sparse_linear_2d_fwd, _sparse_linear_2d_bwd)


# ---------------------------------------------------------------------------------------------
# The Pallas backends: forward and data gradient on compress24(W~), dense (MVUE) weight grad.


def uses_pallas_kernels(backend: str, tokens: int, out_features: int,
                        in_features: int) -> bool:
  """Whether a sparse layer with these (static) sizes runs the Pallas kernels: always for
  'pallas_always', where `compressed_matmul.should_use_pallas_matmul` expects a win for 'pallas'
  (false off a GPU), never for 'xla'. The only place the backend choice is made."""
  if backend == "pallas_always":
    return True
  if backend == "pallas":
    return compressed_matmul.should_use_pallas_matmul(tokens, out_features, in_features)
  return False


def _compress(w: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """compress24(W~) in the compute dtype: values (out, in/2), meta (out, ceil(in/32)) uint32.
  W~ is 2:4 already, so the kernel's top-2-of-|W~| keeps exactly its non-zeros."""
  return sparsify24.compress24(w.astype(dtype), interpret=_common.interpret_default())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pallas_linear_2d(opts: GemmOptions, x: jax.Array, w: jax.Array,
                      key: jax.Array | None) -> jax.Array:
  values, meta = _compress(w, x.dtype)
  return compressed_matmul.sparse24_matmul(x, values, meta,
                                 interpret=_common.interpret_default())  # (N, out)


def _pallas_linear_2d_fwd(opts, x, w, key):
  values, meta = _compress(w, x.dtype)                     # (out, in/2), (out, in/32)
  y = compressed_matmul.sparse24_matmul(x, values, meta,
                              interpret=_common.interpret_default())   # (N, out)
  # The compressed operand (~56% of W~'s bytes) is what dX needs; w itself only for its
  # dtype (a zero-size array: residuals must be arrays).
  return y, (x, values, meta, jnp.zeros((0,), w.dtype), key)


def _pallas_linear_2d_bwd(opts, res, dy):
  x, values, meta, w_dtype_like, key = res
  dx = compressed_matmul.sparse24_matmul_dx(
      dy.astype(values.dtype), values, meta,
      interpret=_common.interpret_default()).astype(x.dtype)            # (N, in)
  # dL/dW~ at every position, pruned ones included (what STE-style projections map to dW).
  dw = _wgrad_gemm(dy, x.astype(dy.dtype), key, opts).astype(w_dtype_like.dtype)  # (out, in)
  dkey = None if key is None else np.zeros(key.shape, jax.dtypes.float0)
  return dx, dw, dkey


_pallas_linear_2d.defvjp(_pallas_linear_2d_fwd, _pallas_linear_2d_bwd)


# ---------------------------------------------------------------------------------------------
# The 'tcgen05' backend: every 2:4 GEMM on Blackwell's sparse tensor cores (kernels/tcgen05.py).
# Compiled for sm_100a (python -m s24jax.kernels.compile_check --gpu b200), never run: no Blackwell
# GPU was available to this project. Off a Blackwell GPU it raises kernels.tcgen05's
# NotBlackwellError (naming the 'xla' backend) when the step is traced.


def _tcgen05():
  tcgen05.check_device()
  return tcgen05


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tcgen05_linear_2d(opts: GemmOptions, x: jax.Array, w: jax.Array,
                       key: jax.Array | None) -> jax.Array:
  values, meta = _compress(w, x.dtype)
  return _tcgen05().forward(x, values, meta)                         # (N, out)


def _tcgen05_linear_2d_fwd(opts, x, w, key):
  values, meta = _compress(w, x.dtype)                               # along in
  y = _tcgen05().forward(x, values, meta)                            # (N, out)
  # dX^T = W~^T dY^T needs W~^T 2:4, i.e. W~ compressed along `out`: only for transposable
  # masks; otherwise dX is the dense XLA GEMM on W~.
  wt = (sparsify24.compress24(w.T.astype(x.dtype), interpret=False) if opts.transposable
        else w.astype(x.dtype))
  return y, (x, wt, key)


def _tcgen05_linear_2d_bwd(opts, res, dy):
  x, wt, key = res
  tc = _tcgen05()
  dy = dy.astype(x.dtype)
  if opts.transposable:
    dx = tc.data_grad(dy, *wt)                                       # (N, in)
  else:
    dx = _dgrad_gemm(dy, wt, opts).astype(x.dtype)                   # (N, in), dense
  if opts.mvue:   # the point of MVUE: dW = MVUE(dY^T) x, 2:4 along the tokens
    if key is None:
      raise ValueError("sparsity.mvue needs a PRNG key (rngs={'sparsity': key})")
    dw = tc.weight_grad(dy, x, mvue24.seed_from_key(key))          # (out, in)
  else:
    dw = _matmul_f32(dy.T, x, ((1,), (0,)))                          # (out, in), dense
  dkey = None if key is None else np.zeros(key.shape, jax.dtypes.float0)
  # w's dtype: the residual wt has it when not transposable; compressed values otherwise.
  w_dtype = wt.dtype if not opts.transposable else wt[0].dtype
  return dx.astype(x.dtype), dw.astype(w_dtype), dkey


_tcgen05_linear_2d.defvjp(_tcgen05_linear_2d_fwd, _tcgen05_linear_2d_bwd)


# ---------------------------------------------------------------------------------------------
# The 'cusparselt' backend: cuSPARSELt's 2:4 GEMMs through the XLA FFI (A100, H100 and newer).
# The GEMM convention is kernels/cusparselt/ops.py's: x (T, K), W~ (N, K), dY (T, N), all
# row-major, passed as they are.


def _cslt_scale(x: jax.Array, fmt, opts: GemmOptions) -> jax.Array:
  """FP8's per-tensor scale of x; under shard_map from the amax of the whole tensor."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  if opts.token_axes:
    amax = jax.lax.pmax(amax, opts.token_axes)
  return fp8_lib.scale_from_amax(amax, fmt)


def _cslt_gemm(a: jax.Array, b: jax.Array, gemm: cusparselt.Gemm, opts: GemmOptions,
               a_format=fp8_lib.E4M3, b_format=fp8_lib.E4M3) -> jax.Array:
  """D array (gemm.d_shape()) float32 of the sparse A array times the B array: A compressed
  here (FP8: quantized first), then `_cslt_prepared_gemm`."""
  if opts.fp8:
    qa, sa = fp8_lib.quantize(a, a_format, _cslt_scale(a, a_format, opts))
  else:
    qa, sa = a, None
  b_dtype = b_format if opts.fp8 else b.dtype
  out = jnp.float32 if opts.fp8 else b.dtype
  compressed = cusparselt.compress(qa, gemm, b_dtype=b_dtype, d_dtype=out)
  return _cslt_prepared_gemm(compressed, qa.dtype, sa, b, gemm, opts, b_format)


def _cslt_prepared_gemm(compressed: jax.Array, a_dtype, a_scale, b: jax.Array,
                        gemm: cusparselt.Gemm, opts: GemmOptions, b_format) -> jax.Array:
  """`_cslt_gemm` with A compressed beforehand (`prepare_weights`): only B is quantized."""
  if opts.fp8:
    qb, sb = fp8_lib.quantize(b, b_format, _cslt_scale(b, b_format, opts))
    dq = (1.0 / a_scale) * (1.0 / sb)
  else:
    qb, dq = b, None
  out = jnp.float32 if opts.fp8 else b.dtype
  d = cusparselt.spmm(compressed, qb, gemm, a_dtype=a_dtype,
                      out_dtype=out).astype(jnp.float32)
  return d if dq is None else d * dq


# The entries `prepare_weights` adds to a sparse layer's 'sparsity' variables for one step.
PREPARED = ("cusparselt_fwd", "cusparselt_dx", "cusparselt_w_scale")


def prepare_weights(w: jax.Array, *, tokens: int, dtype, opts: GemmOptions
                    ) -> dict[str, jax.Array]:
  """W~ (N, K) compressed for the forward and (transposable) the data-gradient GEMM of a
  micro-batch of `tokens` tokens per device, in `dtype` (FP8: e4m3 with W~'s amax scale,
  'cusparselt_w_scale'). The train step computes these once per optimizer step, outside the
  accumulation loop, so that no micro-batch and no recomputed forward compresses W~ again."""
  n, k = w.shape
  w = jax.lax.stop_gradient(w).astype(dtype)
  out_dtype = jnp.float32 if opts.fp8 else jnp.dtype(dtype)
  if opts.fp8:
    qw, sw = fp8_lib.quantize(w, fp8_lib.E4M3)   # W~ is replicated: its own amax is global
  else:
    qw, sw = w, None
  x_dtype = fp8_lib.E4M3 if opts.fp8 else dtype
  prepared = {"cusparselt_fwd": cusparselt.compress(
      qw, _cslt_fwd_gemm(tokens, n, k), b_dtype=x_dtype, d_dtype=out_dtype)}
  if opts.transposable:
    dy_dtype = fp8_lib.E5M2 if opts.fp8 else dtype
    prepared["cusparselt_dx"] = cusparselt.compress(
        qw, _cslt_dgrad_gemm(tokens, n, k), b_dtype=dy_dtype, d_dtype=out_dtype)
  if sw is not None:
    prepared["cusparselt_w_scale"] = sw
  return prepared


def _cslt_fwd_gemm(t: int, n: int, k: int) -> cusparselt.Gemm:
  """y^T (N, T) = W~ (N x K, 2:4 along K) x^T: the A array is W~ itself, B is x."""
  return cusparselt.Gemm(m=n, n=t, k=k, trans_a=True, trans_b=False)


def _cslt_dgrad_gemm(t: int, n: int, k: int) -> cusparselt.Gemm:
  """dX^T (K, T) = W~^T (K x N, 2:4 along N: transposable) dY^T: A is W~, B is dY."""
  return cusparselt.Gemm(m=k, n=t, k=n, trans_a=False, trans_b=False)


def _cslt_wgrad_gemm(t: int, n: int, k: int) -> cusparselt.Gemm:
  """dW (N, K) = MVUE(dY^T) (N x T, 2:4 along T) x: A is MVUE(dY^T), B is x; D is dW^T."""
  return cusparselt.Gemm(m=n, n=k, k=t, trans_a=True, trans_b=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cusparselt_linear_2d(opts: GemmOptions, x: jax.Array, w: jax.Array,
                          key: jax.Array | None, prepared: dict) -> jax.Array:
  t, k = x.shape
  n = w.shape[0]
  if "cusparselt_fwd" in prepared:
    y = _cslt_prepared_gemm(prepared["cusparselt_fwd"], _prepared_dtype(x, opts),
                            prepared.get("cusparselt_w_scale"), x, _cslt_fwd_gemm(t, n, k),
                            opts, fp8_lib.E4M3)                            # (T, N)
  else:
    y = _cslt_gemm(w.astype(x.dtype), x, _cslt_fwd_gemm(t, n, k), opts)   # (T, N)
  return y.astype(x.dtype)


def _prepared_dtype(x: jax.Array, opts: GemmOptions):
  return fp8_lib.E4M3 if opts.fp8 else x.dtype


def _cusparselt_linear_2d_fwd(opts, x, w, key, prepared):
  return _cusparselt_linear_2d(opts, x, w, key, prepared), (x, w, key, prepared)


def _cusparselt_linear_2d_bwd(opts, res, dy):
  x, w, key, prepared = res
  (t, k), n = x.shape, w.shape[0]
  dy = dy.astype(x.dtype)
  if opts.transposable and "cusparselt_dx" in prepared:
    dx = _cslt_prepared_gemm(prepared["cusparselt_dx"], _prepared_dtype(x, opts),
                             prepared.get("cusparselt_w_scale"), dy,
                             _cslt_dgrad_gemm(t, n, k), opts, fp8_lib.E5M2)   # (T, K)
  elif opts.transposable:
    dx = _cslt_gemm(w.astype(x.dtype), dy, _cslt_dgrad_gemm(t, n, k), opts,
                    fp8_lib.E4M3, fp8_lib.E5M2)                       # (T, K)
  else:
    dx = _dgrad_gemm(dy, w.astype(dy.dtype), opts)                    # (T, K), dense
  if opts.mvue:   # the point of MVUE: dW = MVUE(dY^T) x, 2:4 along the tokens
    est = _wgrad_operand(dy, key, opts)                               # (N, T)
    dw = _cslt_gemm(est, x, _cslt_wgrad_gemm(t, n, k), opts,
                    fp8_lib.E5M2, fp8_lib.E4M3).T                     # (N, K)
  else:
    dw = _wgrad_gemm(dy, x, key, opts)                                # (N, K), dense
  dkey = None if key is None else np.zeros(key.shape, jax.dtypes.float0)
  dprepared = jax.tree.map(
      lambda p: (np.zeros(p.shape, jax.dtypes.float0) if not jnp.issubdtype(p.dtype,
                                                                           jnp.floating)
                 else jnp.zeros_like(p)), prepared)
  return dx.astype(x.dtype), dw.astype(w.dtype), dkey, dprepared


_cusparselt_linear_2d.defvjp(_cusparselt_linear_2d_fwd, _cusparselt_linear_2d_bwd)


def _per_device(op, opts: GemmOptions):
  """`op` on each device's own rows of x under the context mesh (jax.sharding.get_abstract_mesh,
  set by the train step): an opaque custom call cannot be partitioned by XLA, which would
  otherwise gather the batch-sharded activations and run the whole global GEMM everywhere.
  W~ is replicated into it (the FSDP all-gather, as for any GEMM); its gradient is summed
  over the devices by shard_map's transpose (the data-parallel all-reduce). MVUE draws from
  fold_in(key, device index), so the shards' estimates are independent; FP8 scales are the
  whole tensors' (a pmax of the shards' amax)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return op
  axes = tuple(mesh.axis_names)
  P = jax.sharding.PartitionSpec

  local_opts = dataclasses.replace(opts, token_axes=axes)

  def local(x, w, key, prepared):
    if key is not None and opts.mvue:
      index = jax.lax.axis_index(axes)
      key = jax.random.fold_in(key, index)
    return op(local_opts, x, w, key, prepared)

  def sharded(opts_, x, w, key, prepared):
    del opts_
    key_spec = None if key is None else P()
    prepared_spec = jax.tree.map(lambda _: P(), prepared)   # per device, as compressed
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(P(axes, None), P(), key_spec, prepared_spec),
                         out_specs=P(axes, None), check_vma=False)(x, w, key, prepared)

  return sharded


def sparse_linear(x: jax.Array, w: jax.Array, key: jax.Array | None = None, *,
                  mvue: bool = False, backend: str = "xla", fp8: bool = False,
                  fp8_backward_operands: str = "e4m3", transposable: bool = False,
                  prepared: dict | None = None) -> jax.Array:
  """y = x W~^T for x (..., in) and a 2:4 W~ (out, in), with the three-GEMM backward.

  Args:
    x: activations (..., in); the compute dtype (y and dX come back in it).
    w: the projected weight W~ (out, in), already 2:4 (the projection's output); its
      gradient comes back in w's dtype.
    key: PRNG key for MVUE (per layer, per step); only used when `mvue` and differentiated.
    mvue: estimate the weight gradient from MVUE(dY^T), 2:4 along tokens (unbiased).
    backend: GEMM implementation, one of BACKENDS ('xla', 'pallas': Pallas kernels where
      they are expected to win, 'pallas_always', 'tcgen05': Blackwell's sparse tensor cores
      for all three GEMMs, 'cusparselt': cuSPARSELt on A100 / H100); see the module
      docstring.
    transposable: W~'s mask is transposable (2:4 along `out` too), so 'tcgen05' runs the
      data-gradient GEMM sparse as well.
    fp8: all three GEMMs in FP8 with per-tensor amax scaling (s24jax/fp8.py): x and W~ in
      e4m3, dY (and its MVUE estimate) in e5m2, fp32 accumulation.
    fp8_backward_operands: with fp8, the format of W~ and x in the two backward GEMMs:
      'e4m3' (as in the forward) or 'e5m2' (re-quantized, as the S-STE reference code does;
      'xla' backend only). The forward is the same either way.
    prepared: 'cusparselt' only: W~ already compressed for this step (`prepare_weights`);
      None compresses it here.

  Returns:
    y (..., out) in x's dtype, accumulated in float32.
  """
  opts = GemmOptions(mvue=mvue, backend=backend, fp8=fp8,
                     fp8_backward_operands=fp8_backward_operands, transposable=transposable)
  if x.shape[-1] != w.shape[-1]:
    raise ValueError(f"sparse_linear: x has {x.shape[-1]} input features (last axis of "
                     f"{tuple(x.shape)}) but W~ {tuple(w.shape)} expects {w.shape[-1]}.")
  lead = x.shape[:-1]
  op = _sparse_linear_2d
  if uses_pallas_kernels(backend, math.prod(lead), w.shape[0], w.shape[1]):
    if w.shape[1] % 4:
      raise ValueError(f"sparse_linear: sparsity.backend={backend!r} needs W~'s input "
                       f"dimension (in_features, here {w.shape[1]} of W~ {tuple(w.shape)}) "
                       "to be a multiple of 4 (2:4 groups along it).")
    op = _pallas_linear_2d
  if backend == "tcgen05":
    op = _tcgen05_linear_2d
  x2 = x.reshape(-1, x.shape[-1])                                    # (N, in)
  if backend == "cusparselt":
    y = _per_device(_cusparselt_linear_2d, opts)(opts, x2, w, key, dict(prepared or {}))
  else:
    y = op(opts, x2, w, key)                                         # (N, out)
  return y.reshape(*lead, w.shape[0])                                # (..., out)
