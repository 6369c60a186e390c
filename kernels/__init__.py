"""Pallas GPU kernels for s24jax, each with a jnp reference.

Public contract (docs/kernels.md, "Public contract"):
  sparsify24.compress24(w, mask=None, *, interpret=False) -> (values [..., K/2], meta)
  sparsify24.decompress24(values, meta) -> dense 2:4 array
  compressed_matmul.sparse24_matmul(x, values, meta, *, interpret=False)
      -> x @ decompress24(values, meta).T
The metadata format is documented in `kernels/_common.py`.

One kernel family per module (Triton backend, sm_80 and sm_90a):
  sparsify24          compress24, soft_compress24, decompress24
  compressed_matmul   sparse24_matmul (+ its dx / dvalues backward)
  transposable_mask   transposable_mask24 (+ W~ and W~^T compressed)
  mvue24              mvue24_compress (unbiased stochastic 2:4)
  venom               venom_compress, venom_matmul (V:2:M activations)
  gated_activation    gated_act, geglu, swiglu
and one Mosaic GPU family for Blackwell (sm_100a), `s24jax.kernels.tcgen05`
(2:4 GEMMs on the sparse tensor cores): not imported here, and it imports
Mosaic GPU only when one of its kernels is built, so the Triton kernels never
load it. No module shares a name with a function, so every module is
reachable as `s24jax.kernels.<module>`. This __init__ imports nothing: import the module
you need (`from s24jax.kernels import sparsify24`), so no import runs in a circle through
the package.

Imports point one way: kernel files -> `_common`, `masks`, `bench_harness` (and
other kernel files, without cycles); the tools `bench` and `compile_check` -> kernel files;
nothing imports a tool, and nothing here imports `s24jax` outside this
package (tests/test_imports.py checks both).

`python -m s24jax.kernels.bench` times the kernels on a GPU (each kernel
file's `python -m s24jax.kernels.<family>` its own rows);
`python -m s24jax.kernels.compile_check --gpu a100|h100|b200` compiles them
for a GPU without one (docs/kernels.md).
"""
