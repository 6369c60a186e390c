"""Pallas GPU kernels for s24jax (Triton backend), each with a jnp reference.

Public contract (DESIGN.md section 7):
  compress24(w, mask=None, *, interpret=False) -> (values [..., K/2], meta)
  decompress24(values, meta) -> dense 2:4 array
  sparse24_matmul(x, values, meta, *, interpret=False)
      -> x @ decompress24(values, meta).T
The metadata format is documented in `kernels/_common.py`. One kernel
family per module: sparsify24, sparse24_matmul, transposable_mask, mvue24,
venom, gated_act; `python -m kernels.bench` times them all on a GPU.

Note: `kernels.sparse24_matmul` and `kernels.gated_act` are the functions;
they shadow the submodules of the same name as package attributes, so reach
those modules with `importlib.import_module("kernels.sparse24_matmul")`.
"""
from kernels.gated_act import (GatedActConfig, gated_act, gated_act_reference,
                               geglu, swiglu)
from kernels.mvue24 import (Mvue24Config, mvue24_compress,
                            mvue24_dense_reference, mvue24_reference,
                            seed_from_key)
from kernels.sparse24_matmul import (PALLAS_MATMUL_MAX_TOKENS,
                                     Sparse24MatmulConfig, should_use_pallas_matmul,
                                     sparse24_matmul, sparse24_matmul_reference)
from kernels.sparsify24 import (Sparsify24Config, compress24,
                                compress24_reference, decompress24,
                                soft_compress24, soft_compress24_reference,
                                soft_threshold24_reference)
from kernels.transposable_mask import (TransposableMaskConfig,
                                       transposable_compressed_reference,
                                       transposable_mask24,
                                       transposable_mask_reference)
from kernels.venom import (VenomConfig, venom_compress, venom_decompress,
                           venom_matmul, venom_matmul_reference,
                           venom_reference)

__all__ = [
    # sparsify24
    "Sparsify24Config", "compress24", "compress24_reference", "decompress24",
    "soft_compress24", "soft_compress24_reference",
    "soft_threshold24_reference",
    # sparse24_matmul
    "PALLAS_MATMUL_MAX_TOKENS", "Sparse24MatmulConfig",
    "should_use_pallas_matmul", "sparse24_matmul", "sparse24_matmul_reference",
    # transposable_mask
    "TransposableMaskConfig", "transposable_compressed_reference",
    "transposable_mask24", "transposable_mask_reference",
    # mvue24
    "Mvue24Config", "mvue24_compress", "mvue24_dense_reference",
    "mvue24_reference", "seed_from_key",
    # venom
    "VenomConfig", "venom_compress", "venom_decompress", "venom_matmul",
    "venom_matmul_reference", "venom_reference",
    # gated_act
    "GatedActConfig", "gated_act", "gated_act_reference", "geglu", "swiglu",
]
