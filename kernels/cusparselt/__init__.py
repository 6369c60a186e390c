"""cuSPARSELt 2:4 sparse GEMMs through the XLA FFI (A100, H100 and newer).

  cusparselt_ffi.cc   the two FFI handlers (compress, spmm), their plan cache and errors
  scratch.h           their device scratch under XLA's FFI rules (alignment at most 16; XLA's
                      allocator messages kept for their errors), compiled alone by a test
  library.py          builds the handlers on first use (g++ against the user's jaxlib FFI
                      headers and the cuSPARSELt / CUDA runtime wheels), loads and registers them
  ops.py              the JAX side: `compress`, `spmm` (jax.ffi.ffi_call), the column-major
                      GEMM convention, and the jnp stand-in the CPU tests put in their place

s24jax uses it as `sparsity.backend='cusparselt'` (s24jax/sparse_ops.py). This __init__
imports nothing.
"""
