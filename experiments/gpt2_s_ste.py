"""2:4 FFN weights with the S-STE recipe (Hu, Zhu, Chen 2024).

  python launch.py --config experiments/gpt2_s_ste.py:small --workdir runs/demo   # the quick start

The recipe: soft threshold S(W) (continuous in W), forward weight beta * S(W) with the
per-tensor scale beta fixed at initialisation (checkpointed), straight-through backward; the
weight gradient from the unbiased MVUE 2:4 estimate of dY^T (sparsity.mvue); all three GEMMs
of the sparse (FFN) layers in FP8 (sparsity.fp8: e4m3 x and W~, e5m2 dY, per-tensor current
amax, fp32 accumulation; simulated on CPU). MVUE exists to make the weight-gradient GEMM 2:4
sparse, and only `--config.sparsity.backend=tcgen05` (Blackwell; compiled, never run) has such
a GEMM: on every other backend MVUE buys nothing yet and costs time (logged once as
perf/mvue_time_share) and gradient variance. It is on because the paper's recipe has it; its
loss cost and FP8's, over seeds: docs/results.md, "Every recipe over seeds".
Ablations:
  --config.sparsity.s_ste.rescale_every=1   recompute beta every step (it grows; logged as
                                            train/method/scale per layer and its mean)
  --config.sparsity.mvue=False              exact weight gradient
  --config.sparsity.fp8=False               fp32 (or bf16) GEMMs
  --config.sparsity.fp8_backward_operands=e5m2   W~ and x re-quantized to e5m2 in the
                                            backward GEMMs (the S-STE reference code; 'xla')

Expected (small, 3-5 minutes on 2 CPU cores): final val loss 1.87-1.89 nats per byte, far
below the unigram entropy of the embedded corpus (3.33), within ~1 % of the dense baseline; the
flip rate peaks at the end of warm-up, then decays; beta stays at its initial value. The band
a run must land in: README, "Quick start". The default (no variant) is paper-scale GPT-2 124M,
300,000 steps of 512 x 1024 tokens: a GPU's run. Where its step does not fit the device's
memory (a CPU's, a small GPU's), launch.py stops before step 1 with exit code 6, naming the
nearest setting that fits (s24jax/training/fit.py), nothing written.
"""
from s24jax.training.config import apply_variant
from s24jax.training.config import base_config


def get_config(variant=None, family="gpt2"):
  config = base_config(family)
  config.sparsity.method = "s_ste"
  config.sparsity.s_ste.rescale_every = 0   # beta fixed at init
  config.sparsity.mvue = True               # MVUE 2:4 dY^T for the weight gradient
  config.sparsity.fp8 = True                # FP8 sparse-layer GEMMs
  return apply_variant(config, variant)
