"""Pallas GPU kernels for s24jax, each with a jnp reference.

Public contract (docs/kernels.md, "Public contract"):
  compress24(w, mask=None, *, interpret=False) -> (values [..., K/2], meta)
  decompress24(values, meta) -> dense 2:4 array
  sparse24_matmul(x, values, meta, *, interpret=False)
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
reachable as `s24jax.kernels.<module>`.

Imports point one way: kernel files -> `_common`, `masks`, `timing` (and
other kernel files, without cycles); the tools `bench` and `compile_check` -> kernel files;
nothing imports a tool, and nothing here imports `s24jax` outside this
package (tests/test_imports.py checks both).

`python -m s24jax.kernels.bench` times the kernels on a GPU (each kernel
file's `python -m s24jax.kernels.<family>` its own rows);
`python -m s24jax.kernels.compile_check --gpu a100|h100|b200` compiles them
for a GPU without one (docs/kernels.md).
"""
from ._common import interpret_default
from .compressed_matmul import (PALLAS_MATMUL_MAX_TOKENS,
                                       Sparse24MatmulConfig,
                                       should_use_pallas_matmul,
                                       sparse24_matmul, sparse24_matmul_dx,
                                       sparse24_matmul_reference)
from .gated_activation import (GatedActConfig, gated_act,
                                      gated_act_reference, geglu, swiglu)
from .mvue24 import (Mvue24Config, mvue24_compress,
                            mvue24_dense_reference, mvue24_reference,
                            seed_from_key)
from .sparsify24 import (Sparsify24Config, compress24,
                                compress24_reference, decompress24,
                                soft_compress24, soft_compress24_reference,
                                soft_threshold24_reference)
from .transposable_mask import (TransposableMaskConfig,
                                       transposable_compressed_reference,
                                       transposable_mask24,
                                       transposable_mask_reference)
from .venom import (VenomConfig, venom_compress, venom_decompress,
                           venom_matmul, venom_matmul_reference,
                           venom_reference)

__all__ = [
    "interpret_default",
    # sparsify24
    "Sparsify24Config", "compress24", "compress24_reference", "decompress24",
    "soft_compress24", "soft_compress24_reference",
    "soft_threshold24_reference",
    # compressed_matmul
    "PALLAS_MATMUL_MAX_TOKENS", "Sparse24MatmulConfig",
    "should_use_pallas_matmul", "sparse24_matmul", "sparse24_matmul_dx",
    "sparse24_matmul_reference",
    # transposable_mask
    "TransposableMaskConfig", "transposable_compressed_reference",
    "transposable_mask24", "transposable_mask_reference",
    # mvue24
    "Mvue24Config", "mvue24_compress", "mvue24_dense_reference",
    "mvue24_reference", "seed_from_key",
    # venom
    "VenomConfig", "venom_compress", "venom_decompress", "venom_matmul",
    "venom_matmul_reference", "venom_reference",
    # gated_activation
    "GatedActConfig", "gated_act", "gated_act_reference", "geglu", "swiglu",
]
