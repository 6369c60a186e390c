"""cuSPARSELt 2:4 sparse GEMMs through the XLA FFI (A100, H100 and newer).

  cusparselt_ffi.cc   the three FFI handlers (compress, spmm, search), their descriptor and
                      plan caches and errors; which libcusparseLt serves them
  scratch.h           their device scratch under XLA's FFI rules (alignment at most 16; XLA's
                      allocator messages kept for their errors), compiled alone by a test
  library.py          builds the handlers on first use (g++ against the user's jaxlib FFI
                      headers and the cuSPARSELt / CUDA runtime wheels), loads and registers
                      them; the library serving the process, the pinned version
  ops.py              the JAX side: `compress`, `spmm` (jax.ffi.ffi_call), the column-major
                      GEMM convention, and the jnp stand-in the CPU tests put in their place
  algorithms.py       the library's algorithm as data: search, check against the default
  layout.py           the compressed operand's byte layout, written by s24jax in jnp
  compression.py      which compression serves an operand (s24jax's or the library's)
  rules.py            what the library accepts, and the audit of a compiled step's calls

s24jax uses it as `sparsity.backend='cusparselt'` (s24jax/sparse_ops/cusparselt.py). This __init__
imports nothing.
"""
