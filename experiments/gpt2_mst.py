"""Mixed Sparsity Training (Hu, Li, Huang): dynamic sparse training of every linear layer with
Sparsity Variation and Hybrid Sparse Attention (docs/algorithms.md, s24jax/methods/mst.py).

  python launch.py --config experiments/gpt2_mst.py:tiny --workdir runs/mst_tiny
  python -m s24jax.flops experiments/gpt2_mst.py:124m        # planned FLOPs, no training

All four linear layers of every block (attn qkv/out, mlp fc/proj) are unstructured-sparse with
Erdos-Renyi layer densities; embeddings and the tied head stay dense. The target sparsity
warms up from dense to 80%, holds 90% in the ultra-sparsification phase, and restores to 70%;
every 100 steps each layer drops its smallest weights (drop fraction 0.3, cosine-annealed)
and regrows as many, 3/4 by gradient magnitude and 1/4 at random. Strided attention
(stride l) runs during the middle half of training, dense causal attention otherwise.
The workdir gets metrics.png, mst_schedule.png (target vs measured sparsity) and
final_metrics.json with the run's training FLOPs against the dense run's.

Expected (tiny): val loss near the dense baseline at equal steps, with fewer training FLOPs
(flops_reduction; the dense lm head bounds it, flops_reduction_no_head excludes the head).
Measured: README, "Mixed Sparsity Training" (experiments/compare_mst.py). 124m: the paper's
setting (seq 1024, l=128).
"""
from s24jax.config import apply_variant, base_config


def get_config(variant=None):
  config = base_config()
  config.sparsity.projection = "mst"
  # The reference's sparse set: every linear layer and the tied LM head / token embedding.
  config.sparsity.sparse_layers = ("*/attn/*", "*/mlp/*", "wte")
  config.sparsity.mst.sparse_attention = "strided"
  config = apply_variant(config, variant)
  if variant == "tiny":
    config.model.attention_stride = 8       # seq_len 64: 8 strided keys per query at the end
    config.sparsity.mst.update_every = 25   # 600 steps: 24 topology updates
  return config
