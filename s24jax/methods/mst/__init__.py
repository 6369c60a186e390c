"""Mixed Sparsity Training (Hu, Li, Huang), one job per module:

  attention_masks  Hybrid Sparse Attention's patterns (the model builds them: s24jax/nn/layers.py)
  schedule    step -> phase, target sparsity, drop fraction, attention pattern
  densities   per-layer sparsities (Erdos-Renyi, uniform) in the reference's layer order
  counts      per-layer update counts and the plan of a whole run (host side, float64)
  topology    the on-device drop-and-grow update and the dense-gradient projection
  method      `MST`, the method (docs/algorithms.md, MST)
  plot        the schedule plot

This __init__ imports nothing (no cycle with the modules it names).
"""
