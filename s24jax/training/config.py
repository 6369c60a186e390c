"""The base experiment config and its size variants (ml-collections).

Experiment files in `experiments/` are a few overrides over `base_config()`:

    def get_config(variant=None):
      config = base_config()
      config.sparsity.method = 's_ste'
      return apply_variant(config, variant)

`config.sparsity.method` names the method (s24jax/methods/); every registered method owns
the block `config.sparsity.<name>` (its hyper-parameters, from the method's dataclass fields),
so `--config.sparsity.t_sr_ste.mask_refresh_every=10` works from the command line. The
mutable ConfigDict lives in launch/config land; the model and the jitted steps close over the
frozen `model.ModelConfig` built from it (`model.model_config`).

One source per default: the blocks `config.model`, the shared fields of `config.sparsity` and
`config.act_sparsity` are generated from the frozen dataclasses they are turned into
(`model.ModelConfig`, `sparse_linear.SparsityConfig`, `act_sparsity.ActSparsityConfig`),
where each field's comment says what it does, and the method blocks from the methods'
dataclasses (`registry.config_blocks`). What is written here is what has no dataclass: the
run (steps, batch, optimizer, data, logging) and the size variants. Importing this module
therefore imports the model and the methods (jax, flax, optax); it imports no data pipeline.
"""
from __future__ import annotations

import dataclasses

import ml_collections
from ml_collections import config_dict

from s24jax.data import defaults as data_defaults
from s24jax.nn import act_sparsity
from s24jax.nn import model as model_lib
from s24jax.nn import sparse_linear
from s24jax.methods import registry

# GPT-2 sizes (Radford et al. 2019; the sizes Hu et al. 2024 train): (layers, heads, width).
GPT2_SIZES = {
    "124m": (12, 12, 768),
    "350m": (24, 16, 1024),
    "774m": (36, 20, 1280),
    "1558m": (48, 25, 1600),
}
# Llama-style sizes (model.family='llama'): (layers, heads, key/value heads, width). 125m: a
# GPT-2 124M-sized Llama (grouped-query, SwiGLU 2048); 1b: TinyLlama 1.1B's width, depth and
# FFN (5632; Zhang et al. 2024; the "Llama 1B" of Haziza et al. 2026 is of this class) with
# Llama 3.2 1B's 8 key/value heads (TinyLlama's 4 do not divide the 8 devices its state is
# sharded over, and cuDNN attention's partitioner then fails to compile: docs/scaling.md); 7b:
# Llama 2 7B's width, depth and FFN (11008) with Llama 3's 8 key/value heads.
LLAMA_SIZES = {
    "125m": (12, 12, 4, 768),
    "1b": (22, 32, 8, 2048),
    "7b": (32, 32, 8, 4096),
}
# CPU variants (apply_variant): 'tiny', the smoke test; 'small', the comparison test bed.
CPU_VARIANTS = ("tiny", "small")
VARIANTS = CPU_VARIANTS + tuple(GPT2_SIZES)
FAMILY_VARIANTS = {"gpt2": VARIANTS, "llama": CPU_VARIANTS + tuple(LLAMA_SIZES)}
# The paper-scale default variant of each family (a variant of None).
DEFAULT_VARIANT = {"gpt2": "124m", "llama": "125m"}
# 1800: the dense baseline's final val loss then varies by < 0.5 % over seeds on both test
# corpora (0.25 % Shakespeare, 0.42 % stdlib source; 600 steps: 0.37 % and 0.76 %).
SMALL_STEPS = 1800


def dataclass_block(cls, exclude=(), **values) -> ml_collections.ConfigDict:
  """A config block with the fields of the frozen dataclass `cls` (its defaults; `values`
  override them), but `exclude`."""
  instance = cls(**values) if values else cls()
  return ml_collections.ConfigDict({f.name: getattr(instance, f.name)
                                    for f in dataclasses.fields(cls) if f.name not in exclude})


def base_config(family: str = "gpt2") -> ml_collections.ConfigDict:
  """GPT-2 124M with the Hu et al. 2024 recipe's optimizer and batch, dense, embedded corpus;
  family='llama': the Llama-style model of that size instead (its defaults below)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.total_steps = 300_000
  c.batch_size = 512              # sequences per optimizer step (global, over all devices)
  # Micro-batches per step: the batch is split into this many inside the jitted step and
  # their gradients summed (memory, not math: the same update as one big batch).
  c.grad_accum_steps = 1
  # The device mesh (s24jax/training/sharding.py): data x fsdp devices, -1 = all the rest. fsdp > 1
  # shards parameters, optimizer and sparsity state ZeRO-3 style; the batch splits over both.
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1})

  # The model (model.ModelConfig's fields: GPT-2 124M).
  c.model = dataclass_block(model_lib.ModelConfig, exclude=model_lib.MODEL_BLOCK_EXCLUDE)
  if family not in FAMILY_VARIANTS:
    raise ValueError(f"unknown model family {family!r}; valid: {', '.join(FAMILY_VARIANTS)}")
  if family == "llama":   # SwiGLU, grouped-query attention at the 125m size
    c.model.family, c.model.activation = "llama", "swiglu"
    c.model.num_layers, c.model.num_heads, c.model.num_kv_heads, c.model.d_model = (
        LLAMA_SIZES["125m"])

  # What is sparse and how (sparse_linear.SparsityConfig's fields), the method by name
  # (registry.available_methods()), and each method's hyper-parameters as its own block.
  c.sparsity = dataclass_block(sparse_linear.SparsityConfig, exclude=("method",))
  c.sparsity.method = "dense"
  for name, block in registry.config_blocks().items():
    if block:
      c.sparsity[name] = ml_collections.ConfigDict(block)

  # V:N:M activation sparsity of the FFN hidden activations (Haziza et al.; the fields of
  # act_sparsity.ActSparsityConfig), and its statistics at every log step: one extra forward
  # on `stats_sequences` sequences; 0 = off.
  c.act_sparsity = dataclass_block(act_sparsity.ActSparsityConfig)
  c.act_sparsity.stats_sequences = 0

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1.5e-4
  c.optim.min_lr = 1e-5
  c.optim.warmup_steps = 3000
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  c.optim.weight_decay = 0.1      # matrices only
  c.optim.grad_clip = 1.0         # global norm; 0 = off

  c.data = data_defaults.data_config()
  # A local Hugging Face GPT2LMHeadModel directory (config.json, model.safetensors and the
  # tokenizer files; s24jax.cli.export writes one) to start a new run from: its weights replace
  # the fresh ones at step 0 (the tokenizer must be the run's). s24jax/cli/export.py.
  c.init_from = config_dict.placeholder(str)

  c.eval_every = 1000
  c.eval_batches = 20
  c.log_every = 50
  c.checkpoint_every = 2000
  c.keep_checkpoints = 3
  c.peak_flops = 0.0              # per device, for MFU; 0: guess from the device kind
  c.stop_at_step = -1             # debug/preemption test: leave the loop at this step
  return c


def apply_variant(c: ml_collections.ConfigDict, variant: str | None) -> ml_collections.ConfigDict:
  """Applies a size variant (VARIANTS): the paper-scale GPT-2 sizes None/'124m', '350m',
  '774m', '1558m' (GPT2_SIZES, with the memory settings of 8 GPUs), or a CPU variant:

  'tiny'   a smoke recipe: a 2-layer, 128-wide GPT-2 with the BPE vocabulary on 16 x 64
           tokens per step; a few minutes on two cores, its 50k-token head is 94% of the
           FLOPs;
  'small'  the CPU test bed of the recipe comparisons (`_small`): 4 layers of width 128 on
           UTF-8 bytes, the FFN most of the FLOPs, SMALL_STEPS steps.
  """
  family = c.model.family
  variant = variant or DEFAULT_VARIANT[family]
  if variant not in FAMILY_VARIANTS[family]:
    raise ValueError(f"unknown config variant {variant!r} for model.family={family!r}; "
                     f"valid: {', '.join(FAMILY_VARIANTS[family])}")
  if family == "llama":
    return _llama(c, variant)
  if variant in GPT2_SIZES:
    c.model.num_layers, c.model.num_heads, c.model.d_model = GPT2_SIZES[variant]
    # The paper's global batch (512 x 1024 tokens) on 8 GPUs: micro-batches of 64 sequences
    # (8 per GPU), 8 accumulation steps; blocks scanned (compile time independent of depth),
    # matmul outputs kept and the rest recomputed, the loss chunked. 774M and 1.5B shard
    # their state over every device (ZeRO-3). `python -m s24jax.perf.plan` checks a GPU count:
    # docs/scaling.md, "Planning a run".
    c.grad_accum_steps = 8
    c.model.scan_layers = True
    c.model.remat = "save_dots"
    c.model.loss_chunk = 2048
    if variant in ("774m", "1558m"):
      c.mesh.fsdp, c.mesh.data = -1, 1
    return c
  if variant == "small":
    return _small(c)
  return apply_variant_tiny(c)


def apply_variant_tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """'tiny' (apply_variant)."""
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


def _llama(c: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
  """The Llama-style variants: the CPU ones as GPT-2's with 2 key/value heads and the FFN
  rounded to a multiple of 32 ('small': SwiGLU 352 on width 128, the FFN 64 % of the training
  FLOPs), or a paper-scale size (LLAMA_SIZES) with the memory settings of 8 GPUs: 125m at
  GPT-2's batch (512 x 1024 tokens), 1b and 7b at 2048 tokens per sequence, 256 sequences
  per step (the same tokens), their state sharded over every device."""
  if variant in CPU_VARIANTS:
    c = _small(c) if variant == "small" else apply_variant_tiny(c)
    c.model.num_kv_heads = 2
    c.model.ffn_multiple_of = 32
    return c
  c.model.num_layers, c.model.num_heads, c.model.num_kv_heads, c.model.d_model = (
      LLAMA_SIZES[variant])
  c.grad_accum_steps = 8
  c.model.scan_layers = True
  c.model.remat = "save_dots"
  c.model.loss_chunk = 2048
  if variant != "125m":
    c.model.seq_len = 2048
    c.batch_size = 256
    c.grad_accum_steps = 4
    c.mesh.fsdp, c.mesh.data = -1, 1
  return c


def _small(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The CPU test bed: GPT-2's architecture, 4 layers of width 128, on UTF-8 bytes.

  The byte vocabulary keeps the head small, so the FFN (the layers every method makes 2:4
  sparse) is most of the model and of the training FLOPs (`python -m s24jax.cli.flops
  experiments/gpt2_dense.py:small`), unlike `tiny`, whose 50k-token head is 94% of both.
  Sized so that one run takes a few minutes on one CPU core and the dense baseline's val loss
  varies little across seeds (docs/results.md).
  """
  c.data.tokenizer = "bytes"
  c.model.vocab_size = 320        # 257 byte ids padded to a multiple of 64
  c.total_steps = SMALL_STEPS
  c.batch_size = 8                # 8 x 128 = 1024 tokens per step
  c.model.seq_len = 128
  c.model.num_layers, c.model.num_heads, c.model.d_model = 4, 4, 128
  c.optim.lr = 2e-3
  c.optim.min_lr = 2e-4
  c.optim.warmup_steps = 60
  c.optim.weight_decay = 0.1
  c.eval_every = 200
  c.eval_batches = 32             # 32 x 8 x 128 = 32k held-out bytes
  c.log_every = 20
  c.checkpoint_every = 200
  return c
