"""Sparse-training methods, one module each, behind the interface of `base.Method`.

  base       the interface (core hooks, optional capabilities) and shared helpers
  registry   name -> method: register_method, register_projection, get_method, from_config
  straight_through  the straight-through rule every hard-mask method projects with
  dense      no sparsity (and the dense fine-tuning twin of every method)
  ste        hard-threshold 2:4, straight-through
  function   a method from a plain projection function (register_projection)
  sr_ste     + SR-STE masked decay, lambda_W fixed or chosen in warm-up
  t_sr_ste   Hu et al. 2024: + a cached transposable mask
  s_ste      S-STE: soft threshold, frozen per-tensor scale
  mst/       Mixed Sparsity Training: dynamic unstructured sparsity, sparsity variation,
             hybrid sparse attention

A new method is one module: a `base.Method` subclass, registered with
`registry.register_method(name, Method())`. This package's __init__ imports nothing, so the
method modules and the registry never import each other in a circle.
"""
