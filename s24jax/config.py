"""The base experiment config, its size variants, and the frozen dataclasses the model sees.

Experiment files in `experiments/` are a few overrides over `base_config()`:

    def get_config(arg=None):
      config = base_config()
      config.sparsity.projection = 's_ste'
      return apply_variant(config, arg)

The mutable `ml_collections.ConfigDict` lives only in launch/config land; `ModelConfig` and
`SparsityConfig` (frozen, hashable) are what the model and the jitted steps close over.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from s24jax import attention_masks
from s24jax import data as data_lib
from s24jax import sparse_ops

# GPT-2 sizes from DESIGN.md section 6: (layers, heads, width).
GPT2_SIZES = {
    "124m": (12, 12, 768),
    "350m": (24, 16, 1024),
    "774m": (36, 20, 1280),
    "1558m": (48, 25, 1600),
}
VARIANTS = ("tiny",) + tuple(GPT2_SIZES)
ACTIVATIONS = ("gelu", "relu", "relu2", "geglu", "swiglu")
DECAY_PLACEMENTS = ("gradients", "weights", "backward")
ACT_SPARSITIES = ("none", "venom")   # sparsity.act_sparsity (s24jax/act_sparsity.py)


@dataclasses.dataclass(frozen=True)
class SparsityConfig:
  """Which layers are 2:4 sparse and how (DESIGN.md section 4)."""
  projection: str = "dense"
  # Glob patterns over module paths ('h_3/mlp/fc'); matching linear layers are sparse.
  sparse_layers: tuple[str, ...] = ("*/mlp/*",)
  decay: float = 0.0                   # SR-STE masked decay factor lambda_W
  decay_placement: str = "gradients"   # 'gradients' (Hu et al.), 'weights', 'backward'
  dense_finetune_fraction: float = 0.0  # last fraction of steps trained dense
  # The sparse layers' GEMMs (s24jax/sparse_ops.py): 'xla' (reference), 'pallas' (Pallas
  # kernels where they are expected to win: GPU, few tokens; xla elsewhere), 'pallas_always'.
  backend: str = "xla"
  # S-STE: recompute the scale beta every k optimizer steps; 0 = fixed at init (the recipe).
  rescale_every: int = 0
  # FP8 GEMMs in the sparse layers (s24jax/fp8.py): e4m3 forward operands, e5m2 gradients.
  fp8: bool = False
  # V:N:M activation sparsity of the FFN hidden activations that feed the second FFN matmul
  # (Haziza et al.; s24jax/act_sparsity.py): 'none' or 'venom'; blocks of act_v token rows,
  # act_n kept of act_m hidden columns per row (4 columns chosen per block); act_backend is
  # the matmul on the sparse activation ('xla' reference; kernels register others).
  act_sparsity: str = "none"
  act_v: int = 64
  act_n: int = 2
  act_m: int = 8
  act_backend: str = "xla"
  # Hu et al. 2024 (projection 't_sr_ste'): optimizer steps between refreshes of the cached
  # transposable mask (state['mask']); the forward uses the cached mask in between.
  mask_refresh_every: int = 40
  # Weight gradient of the sparse layers from the unbiased MVUE 2:4 estimate of dY^T along
  # the tokens (s24jax/sparse_ops.py; Hu et al. 2024, S-STE). Needs batch x seq_len % 4 == 0.
  mvue: bool = False
  # Automatic lambda_W (s24jax/decay_control.py), only when decay == 0 and decay_auto: a
  # controller multiplies lambda by decay_auto_rate (or divides) whenever the smoothed global
  # flip rate leaves [target / band, target * band], starting at decay_auto_init, during the
  # first decay_auto_steps optimizer steps (0: optim.warmup_steps); then lambda is frozen.
  decay_auto: bool = False
  decay_auto_init: float = 6e-5
  decay_auto_target: float = 3e-3
  decay_auto_band: float = 2.0
  decay_auto_rate: float = 1.1
  decay_auto_steps: int = 0
  # Flip-rate warning (s24jax/flip_monitor.py): absl warning and train/flip_rate_warning = 1
  # when the logged global flip rate exceeds flip_rate_warn for flip_rate_warn_patience
  # consecutive logs; 0 turns it off.
  flip_rate_warn: float = 0.05
  flip_rate_warn_patience: int = 5

  def __post_init__(self):
    if self.backend not in sparse_ops.BACKENDS:
      raise ValueError(f"unknown sparsity.backend {self.backend!r}; valid: "
                       f"{', '.join(sparse_ops.BACKENDS)}")
    if self.decay_placement not in DECAY_PLACEMENTS:
      raise ValueError(f"unknown sparsity.decay_placement {self.decay_placement!r}; valid: "
                       f"{', '.join(DECAY_PLACEMENTS)}")
    if self.rescale_every < 0:
      raise ValueError(f"sparsity.rescale_every must be >= 0 (0 = fixed scale), got "
                       f"{self.rescale_every}")
    if self.act_sparsity not in ACT_SPARSITIES:
      raise ValueError(f"unknown sparsity.act_sparsity {self.act_sparsity!r}; valid: "
                       f"{', '.join(ACT_SPARSITIES)}")
    if self.act_v < 1 or self.act_m < 4 or not 0 <= self.act_n <= 4:
      raise ValueError("V:N:M activation sparsity needs sparsity.act_v >= 1, act_m >= 4 and "
                       f"0 <= act_n <= 4 (n of the 4 chosen columns); got act_v={self.act_v}, "
                       f"act_n={self.act_n}, act_m={self.act_m}")
    if not 0.0 <= self.dense_finetune_fraction <= 1.0:
      raise ValueError("sparsity.dense_finetune_fraction must be in [0, 1], got "
                       f"{self.dense_finetune_fraction}")
    if self.mask_refresh_every < 1:
      raise ValueError(f"sparsity.mask_refresh_every must be >= 1 (optimizer steps), got "
                       f"{self.mask_refresh_every}")
    if self.decay_auto:
      if self.decay_placement == "backward":
        raise ValueError("sparsity.decay_auto chooses lambda_W in the optimizer; use "
                         "sparsity.decay_placement 'gradients' or 'weights', not 'backward'")
      if not (self.decay_auto_init > 0 and self.decay_auto_target > 0
              and self.decay_auto_band > 1 and self.decay_auto_rate > 1
              and self.decay_auto_steps >= 0):
        raise ValueError("sparsity.decay_auto needs decay_auto_init > 0, decay_auto_target > 0, "
                         "decay_auto_band > 1, decay_auto_rate > 1, decay_auto_steps >= 0; got "
                         f"{self.decay_auto_init}, {self.decay_auto_target}, "
                         f"{self.decay_auto_band}, {self.decay_auto_rate}, "
                         f"{self.decay_auto_steps}")
    if self.flip_rate_warn < 0 or self.flip_rate_warn_patience < 1:
      raise ValueError("sparsity.flip_rate_warn must be >= 0 (0 = off) and "
                       "sparsity.flip_rate_warn_patience >= 1; got "
                       f"{self.flip_rate_warn}, {self.flip_rate_warn_patience}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """GPT-2 hyper-parameters (frozen: the model closes over it)."""
  vocab_size: int = 50304     # GPT-2's 50257 padded to a multiple of 64
  seq_len: int = 1024
  num_layers: int = 12
  num_heads: int = 12
  d_model: int = 768
  mlp_ratio: float = 4.0
  activation: str = "gelu"
  dtype: str = "float32"      # compute dtype; parameters stay float32
  # Attention pattern (s24jax/attention_masks.py): 'causal' (dense), or MST's Hybrid Sparse
  # Attention patterns 'strided' / 'local_strided' with stride (and local window) l.
  attention: str = "causal"
  attention_stride: int = 128
  sparsity: SparsityConfig = SparsityConfig()

  @property
  def mlp_hidden(self) -> int:
    return int(self.mlp_ratio * self.d_model)

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"unknown model.activation {self.activation!r}; valid: "
                       f"{', '.join(ACTIVATIONS)}")
    if self.sparsity.act_sparsity != "none" and self.mlp_hidden % self.sparsity.act_m:
      raise ValueError(f"V:N:M activation sparsity needs the FFN hidden dimension "
                       f"(model.mlp_ratio * model.d_model = {self.mlp_hidden}) to be a multiple "
                       f"of sparsity.act_m={self.sparsity.act_m}")
    if self.d_model % self.num_heads:
      raise ValueError(f"model.d_model={self.d_model} is not divisible by "
                       f"model.num_heads={self.num_heads}")
    attention_masks.check_pattern(self.attention, self.attention_stride)


def _fields(cls, cfg) -> dict[str, Any]:
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = set(cfg.keys()) - names
  if unknown:
    raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}; valid: {sorted(names)}")
  return {k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items()}


def sparsity_config(config: ml_collections.ConfigDict) -> SparsityConfig:
  sparsity = SparsityConfig(**_fields(SparsityConfig, config.sparsity))
  if sparsity.decay_auto and not sparsity.decay_auto_steps:   # 0: lambda_W is chosen in warm-up
    sparsity = dataclasses.replace(sparsity, decay_auto_steps=int(config.optim.warmup_steps))
  return sparsity


def model_config(config: ml_collections.ConfigDict, *, dense: bool = False) -> ModelConfig:
  """The frozen model config; `dense=True` gives the dense fine-tuning twin."""
  sparsity = sparsity_config(config)
  if dense:
    # The dense twin is dense everywhere: weights and (Haziza et al.) activations.
    sparsity = dataclasses.replace(sparsity, projection="dense", act_sparsity="none")
  kwargs = _fields(ModelConfig, {k: v for k, v in config.model.items()})
  return ModelConfig(**kwargs, sparsity=sparsity)


def base_config() -> ml_collections.ConfigDict:
  """GPT-2 124M, Hu et al. 2024 recipe (DESIGN.md section 6), dense, embedded corpus."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.total_steps = 300_000
  c.batch_size = 512              # sequences per step (global, split over devices)
  c.grad_accum_steps = 1          # micro-batches per step (memory, not math)

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 50304
  c.model.seq_len = 1024
  c.model.num_layers, c.model.num_heads, c.model.d_model = GPT2_SIZES["124m"]
  c.model.mlp_ratio = 4.0
  c.model.activation = "gelu"
  c.model.dtype = "auto"          # bfloat16 on GPU/TPU, float32 on CPU
  c.model.attention = "causal"    # outside MST's sparse-attention window (attention_masks.py)
  c.model.attention_stride = 128  # l of the strided / local_strided patterns

  c.sparsity = ml_collections.ConfigDict(dataclasses.asdict(SparsityConfig()))
  c.sparsity.sparse_layers = ("*/mlp/*",)

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1.5e-4
  c.optim.min_lr = 1e-5
  c.optim.warmup_steps = 3000
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  c.optim.weight_decay = 0.1      # matrices only
  c.optim.grad_clip = 1.0

  c.data = data_lib.default_data_config()

  c.eval_every = 1000
  c.eval_batches = 20
  c.log_every = 50
  c.checkpoint_every = 2000
  c.keep_checkpoints = 3
  c.plot_every = 0                # 0: plot at evals and at the end
  c.peak_flops = 0.0              # per device, for MFU; 0: guess from the device kind
  # Activation sparsity statistics (s24jax/act_sparsity.py): at every log step one extra
  # forward pass on the first this-many sequences of the step's batch; 0 = off.
  c.act_stats_sequences = 0
  c.stop_at_step = -1             # debug/preemption test: leave the loop at this step
  c.mst = mst_config()
  return c


def mst_config() -> ml_collections.ConfigDict:
  """Mixed Sparsity Training (s24jax/mst.py; DESIGN.md section 4). Active when
  sparsity.projection == 'mst' (topology) and mst.sparse_attention != 'causal' (attention)."""
  m = ml_collections.ConfigDict()
  m.update_every = 100            # Delta: steps between topology updates
  m.drop_fraction = 0.3           # zeta: drop fraction, cosine-annealed zeta/2 (1 + cos(pi t/T))
  m.anneal_per_phase = False      # restart the cosine in every sparsity phase (piecewise)
  m.grow_ratio = 3.0              # r: a share r/(r+1) of regrowth by |gradient|, the rest random
  m.distribution = "erdos_renyi"  # layer densities: 'erdos_renyi' or 'uniform'
  # Sparsity Variation: three phases (fractions of total_steps); in each phase the target
  # sparsity moves by a cosine ramp over the first `ramp_fraction` of the phase to the phase's
  # level, then holds it: warm-up -> target, ultra-sparsification -> ultra, restoration -> final.
  m.initial_sparsity = 0.0        # dense start
  m.target_sparsity = 0.8
  m.ultra_sparsity = 0.9
  m.final_sparsity = 0.7          # restoration: back toward dense
  m.phase_fractions = (0.25, 0.5, 0.25)
  m.ramp_fraction = 0.5
  # Hybrid Sparse Attention: this pattern during [start, end) (fractions of total_steps),
  # model.attention outside; 'causal' turns it off.
  m.sparse_attention = "causal"
  m.sparse_attention_start = 0.25
  m.sparse_attention_end = 0.75
  return m


def apply_variant(c: ml_collections.ConfigDict, variant: str | None) -> ml_collections.ConfigDict:
  """Applies a size variant: None/'124m' (paper scale), '350m', '774m', '1558m', 'tiny'.

  'tiny' is a CPU smoke recipe: a 4-layer, 128-wide GPT-2 that trains in a few minutes on
  two cores and ends well below the unigram entropy of the embedded corpus.
  """
  variant = variant or "124m"
  if variant not in VARIANTS:
    raise ValueError(f"unknown config variant {variant!r}; valid: {', '.join(VARIANTS)}")
  if variant in GPT2_SIZES:
    c.model.num_layers, c.model.num_heads, c.model.d_model = GPT2_SIZES[variant]
    if variant in ("350m", "1558m"):
      c.sparsity.decay = 2e-4 if c.sparsity.decay else 0.0   # Hu et al.'s per-size lambda_W
    return c
  # tiny
  c.total_steps = 600
  c.batch_size = 16
  c.model.seq_len = 64
  c.model.num_layers, c.model.num_heads, c.model.d_model = 2, 4, 128
  c.optim.lr = 3e-3
  c.optim.min_lr = 3e-4
  c.optim.warmup_steps = 50
  c.optim.weight_decay = 0.1
  c.eval_every = 100
  c.eval_batches = 8
  c.log_every = 10
  c.checkpoint_every = 100
  return c
