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

This module imports no data pipeline and no model: `import s24jax.config` is cheap.
"""
from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from s24jax.methods import registry

# GPT-2 sizes (Radford et al. 2019; the sizes Hu et al. 2024 train): (layers, heads, width).
GPT2_SIZES = {
    "124m": (12, 12, 768),
    "350m": (24, 16, 1024),
    "774m": (36, 20, 1280),
    "1558m": (48, 25, 1600),
}
# CPU variants (apply_variant): 'tiny', the smoke test; 'small', the comparison test bed.
CPU_VARIANTS = ("tiny", "small")
VARIANTS = CPU_VARIANTS + tuple(GPT2_SIZES)
# The embedded corpus (s24jax/data/text_corpus.py builds it) and its held-out share.
EMBEDDED_CORPUS = "shakespeare"
DEFAULT_VAL_FRACTION = 0.1
# 1800: the dense baseline's final val loss then varies by < 0.5 % over seeds on both test
# corpora (0.25 % Shakespeare, 0.42 % stdlib source; 600 steps: 0.37 % and 0.76 %).
SMALL_STEPS = 1800


def data_config() -> ml_collections.ConfigDict:
  """`config.data`. Optional fields are typed placeholders so flags can set them."""
  return ml_collections.ConfigDict({
      # 'shakespeare', 'text_folder' (or set `path`), or any TFDS text dataset name.
      "name": EMBEDDED_CORPUS,
      "tokenizer": "gpt2",  # 'gpt2' (BPE, 50257 ids) or 'bytes' (UTF-8 bytes, 257 ids).
      "path": config_dict.placeholder(str),  # Folder of .txt files, one document per file.
      "cache_dir": config_dict.placeholder(str),  # Default: $S24JAX_CACHE or ~/.cache/s24jax.
      "tfds_data_dir": config_dict.placeholder(str),  # Default: TFDS's own ($TFDS_DATA_DIR...).
      "val_fraction": DEFAULT_VAL_FRACTION,  # Share of documents held out.
      "text_key": "text",  # Feature holding the text in TFDS datasets.
      "max_docs": config_dict.placeholder(int),  # Cap on documents per split (quick tests).
  })


def base_config() -> ml_collections.ConfigDict:
  """GPT-2 124M with the Hu et al. 2024 recipe's optimizer and batch, dense, embedded corpus."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.total_steps = 300_000
  c.batch_size = 512              # sequences per optimizer step (global, over all devices)
  # Micro-batches per step: the batch is split into this many inside the jitted step and
  # their gradients summed (memory, not math: the same update as one big batch).
  c.grad_accum_steps = 1
  # The device mesh (s24jax/sharding.py): data x fsdp devices, -1 = all the rest. fsdp > 1
  # shards parameters, optimizer and sparsity state ZeRO-3 style; the batch splits over both.
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1})

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 50304      # GPT-2's 50257 padded to a multiple of 64
  c.model.seq_len = 1024
  c.model.num_layers, c.model.num_heads, c.model.d_model = GPT2_SIZES["124m"]
  c.model.mlp_ratio = 4.0
  c.model.activation = "gelu"     # gelu, relu, relu2, geglu, swiglu
  c.model.dtype = "auto"          # bfloat16 on GPU/TPU, float32 on CPU
  c.model.attention = "causal"    # outside MST's sparse-attention window (attention_masks.py)
  c.model.attention_stride = 128  # l of the strided / local_strided patterns
  # Memory (s24jax/model.py): attention kernel ('auto': cuDNN flash attention for causal
  # attention on a GPU, XLA otherwise), per-block rematerialization ('none', 'full',
  # 'save_dots'), chunked loss (tokens per chunk; 0: the plain (B, T, V) f32 logits).
  c.model.attention_impl = "auto"
  c.model.remat = "none"
  c.model.loss_chunk = 0
  c.model.scan_layers = False     # blocks under nn.scan: compile time independent of depth

  c.sparsity = ml_collections.ConfigDict()
  c.sparsity.method = "dense"            # the method: registry.available_methods()
  c.sparsity.sparse_layers = ("*/mlp/*",)    # globs over module paths: both FFN matrices
  # The sparse layers' GEMMs (s24jax/sparse_ops.py): 'xla' (reference), 'pallas' (Pallas
  # kernels where they are expected to win: GPU, few tokens), 'pallas_always'.
  c.sparsity.backend = "xla"
  # Weight gradient from the unbiased MVUE 2:4 estimate of dY^T along the tokens (Hu et al.
  # 2024, S-STE); needs batch x seq_len % 4 == 0.
  c.sparsity.mvue = False
  c.sparsity.fp8 = False                     # FP8 GEMMs in the sparse layers (s24jax/fp8.py)
  # FP8 backward GEMMs' W~ / x: 'e4m3' (as forward) or 'e5m2' (S-STE reference; 'xla' only).
  c.sparsity.fp8_backward_operands = "e4m3"
  c.sparsity.dense_finetune_fraction = 0.0   # the last fraction of steps trains dense
  # Dense fine-tuning starts from the 'latent' W (the reference code: pruned weights come
  # back) or the 'projected' W~ (the sparse network itself: no loss jump at the switch).
  c.sparsity.dense_finetune_init = "latent"
  # Warning (log + train/flip_rate_warning) when the global flip rate stays above this for
  # `flip_rate_warn_patience` consecutive logs; 0 turns it off (s24jax/flip_monitor.py).
  c.sparsity.flip_rate_warn = 0.05
  c.sparsity.flip_rate_warn_patience = 5
  for name, block in registry.config_blocks().items():   # each method's hyper-parameters
    if block:
      c.sparsity[name] = ml_collections.ConfigDict(block)

  # V:N:M activation sparsity of the FFN hidden activations (Haziza et al.; act_sparsity.py).
  c.act_sparsity = ml_collections.ConfigDict()
  c.act_sparsity.kind = "none"    # 'none' or 'venom'
  c.act_sparsity.v = 64           # token rows per block
  c.act_sparsity.n = 2            # kept per row of the block's 4 chosen columns
  c.act_sparsity.m = 8            # hidden columns per block: density n / m
  c.act_sparsity.backend = "xla"  # 'xla' (reference) or 'pallas' (kernels/venom.py)
  # Statistics at every log step: one extra forward on this many sequences; 0 = off.
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

  c.data = data_config()

  c.eval_every = 1000
  c.eval_batches = 20
  c.log_every = 50
  c.checkpoint_every = 2000
  c.keep_checkpoints = 3
  c.peak_flops = 0.0              # per device, for MFU; 0: guess from the device kind
  c.stop_at_step = -1             # debug/preemption test: leave the loop at this step
  return c


def apply_variant(c: ml_collections.ConfigDict, variant: str | None) -> ml_collections.ConfigDict:
  """Applies a size variant: None/'124m' (paper scale), '350m', '774m', '1558m', 'tiny'.

  'tiny' is a CPU smoke recipe: a 2-layer, 128-wide GPT-2 on 16 x 64 tokens per step that
  trains in a few minutes on two cores and ends well below the unigram entropy of the
  embedded corpus.
  """
  variant = variant or "124m"
  if variant not in VARIANTS:
    raise ValueError(f"unknown config variant {variant!r}; valid: {', '.join(VARIANTS)}")
  if variant in GPT2_SIZES:
    c.model.num_layers, c.model.num_heads, c.model.d_model = GPT2_SIZES[variant]
    # The paper's global batch (512 x 1024 tokens) on 8 GPUs: micro-batches of 64 sequences
    # (8 per GPU), 8 accumulation steps; blocks scanned (compile time independent of depth),
    # matmul outputs kept and the rest recomputed, the loss chunked. 774M and 1.5B shard
    # their state over every device (ZeRO-3). `python -m s24jax.plan` checks a GPU count:
    # README, "Planning a run".
    c.grad_accum_steps = 8
    c.model.scan_layers = True
    c.model.remat = "save_dots"
    c.model.loss_chunk = 2048
    if variant in ("774m", "1558m"):
      c.mesh.fsdp, c.mesh.data = -1, 1
    return c
  if variant == "small":
    return _small(c)
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


def _small(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The CPU test bed: GPT-2's architecture, 4 layers of width 128, on UTF-8 bytes.

  The byte vocabulary keeps the head small, so the FFN (the layers every method makes 2:4
  sparse) is most of the model and of the training FLOPs (`python -m s24jax.flops
  experiments/gpt2_dense.py:small`), unlike `tiny`, whose 50k-token head is 94% of both.
  Sized so that one run takes a few minutes on one CPU core and the dense baseline's val loss
  varies little across seeds (README, "Results on the small config").
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
