"""Hu et al. 2024, the full recipe: every FFN GEMM 2:4 sparse, then dense fine-tuning.

  python launch.py --config experiments/gpt2_t_sr_ste_df.py:tiny --workdir runs/t_sr_ste_df_tiny
  # lambda_W chosen automatically during warm-up instead of the paper's value:
  python launch.py --config experiments/gpt2_t_sr_ste_df.py:tiny \\
      --config.sparsity.decay=0 --config.sparsity.decay_auto=True

What it sets (the paper's hyper-parameters; the rest is the GPT-2 recipe of base_config):
- projection 't_sr_ste': transposable 2:4 masks (both W~ and W~^T are 2:4, chosen "by
  convolution" over the 90 4x4 patterns), cached and refreshed every 40 optimizer steps;
- so the three GEMMs of every FFN linear are 2:4 sparse (s24jax/sparse_ops.py): y = x W~^T,
  dX = dY W~, and dW = MVUE(dY^T) x with the unbiased 2:4 estimator along the tokens;
- SR-STE masked decay on the gradients, after clipping, before AdamW: lambda_W = 6e-5 at
  124m / 774m, 2e-4 at 350m / 1558m (config.apply_variant);
- dense fine-tuning for the last 1/6 of the steps (GPT-2: from 250k of 300k).

Expected (tiny, 2 CPU cores, ~10 min at 300 steps when the cores are free): val loss well
below the unigram entropy (measured at 300 steps: 5.85 vs 6.42; dense 5.68). The gap to dense
is mostly the 40-step mask refresh: tiny's lr (3e-3) is 20x the paper's, so a mask cached for
40 steps goes stale; with --config.sparsity.mask_refresh_every=1 the same run ends at 5.69
(experiments/compare_hu2024.py has the table). The flip rate (logged at refreshes, as changed
entries / 40 per step) decays from ~8e-3; `train/transposable_kept_ratio` (~0.945: the |W|
the transposable mask keeps relative to the row-wise 2:4 mask) is logged at refreshes;
`train/sparsity/decay` is lambda_W.
"""
from s24jax.config import apply_variant, base_config


def get_config(variant=None):
  config = base_config()
  config.sparsity.projection = "t_sr_ste"
  config.sparsity.sparse_layers = ("*/mlp/*",)   # FFN sparse, attention dense (the paper)
  config.sparsity.mask_refresh_every = 40
  config.sparsity.mvue = True
  config.sparsity.decay = 6e-5                   # apply_variant: 2e-4 for 350m / 1558m
  config.sparsity.decay_placement = "gradients"
  config.sparsity.dense_finetune_fraction = 1 / 6
  return apply_variant(config, variant)
