// Helpers of the cuSPARSELt FFI handlers (cusparselt_ffi.cc): error macros that turn a failed
// cuSPARSELt or CUDA call into an FFI error naming it, and the element types as XLA, the
// library and ops.py name them. Header-only; part of the handlers' build and cache key
// (library.py, HEADERS).
#ifndef S24JAX_CUSPARSELT_FFI_SUPPORT_H_
#define S24JAX_CUSPARSELT_FFI_SUPPORT_H_

#include <cuda_runtime_api.h>
#include <cusparseLt.h>

#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace s24jax_cusparselt {

inline std::string Status(const char* call, cusparseStatus_t status) {
  return std::string("cuSPARSELt: ") + call + " failed with status " +
         std::to_string(static_cast<int>(status)) + " (" + cusparseLtGetErrorName(status) +
         ": " + cusparseLtGetErrorString(status) +
         "; CUSPARSELT_LOG_LEVEL=1 prints the library's reason)";
}

#define S24_CUSPARSELT(call)                                                          \
  do {                                                                                \
    cusparseStatus_t s24_status = (call);                                             \
    if (s24_status != CUSPARSE_STATUS_SUCCESS)                                        \
      return ::xla::ffi::Error::Internal(Status(#call, s24_status));                         \
  } while (0)

#define S24_CUDA(call)                                                                \
  do {                                                                                \
    cudaError_t s24_cuda = (call);                                                    \
    if (s24_cuda != cudaSuccess)                                                      \
      return ::xla::ffi::Error::Internal(std::string("CUDA: ") + #call + " failed: " +       \
                                  cudaGetErrorName(s24_cuda) + ": " +                 \
                                  cudaGetErrorString(s24_cuda));                      \
  } while (0)

#define S24_RETURN_IF_ERROR(expr)                                                     \
  do {                                                                                \
    if (::xla::ffi::Error s24_error = (expr); s24_error.failure()) return s24_error; \
  } while (0)

inline xla::ffi::ErrorOr<cudaDataType> CudaType(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::BF16: return CUDA_R_16BF;
    case xla::ffi::DataType::F16: return CUDA_R_16F;
    case xla::ffi::DataType::F32: return CUDA_R_32F;
    case xla::ffi::DataType::F8E4M3FN: return CUDA_R_8F_E4M3;
    case xla::ffi::DataType::F8E5M2: return CUDA_R_8F_E5M2;
    default:
      return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(
          "cuSPARSELt: unsupported element type " + std::to_string(static_cast<int>(t)) +
          " (bf16, f16: sm_80+; e4m3, e5m2: sm_90+)"));
  }
}

inline size_t ElementBytes(int type) {
  return type == CUDA_R_32F ? 4 : type == CUDA_R_16BF || type == CUDA_R_16F ? 2 : 1;
}

// The dtype attributes' names (ops.py: _DTYPE_NAMES) -> XLA's element types.
inline xla::ffi::DataType TypeNamed(std::string_view name) {
  if (name == "bf16") return xla::ffi::DataType::BF16;
  if (name == "f16") return xla::ffi::DataType::F16;
  if (name == "e4m3") return xla::ffi::DataType::F8E4M3FN;
  if (name == "e5m2") return xla::ffi::DataType::F8E5M2;
  return xla::ffi::DataType::F32;
}

inline cusparseOperation_t Op(bool trans) {
  return trans ? CUSPARSE_OPERATION_TRANSPOSE : CUSPARSE_OPERATION_NON_TRANSPOSE;
}

}  // namespace s24jax_cusparselt

#endif  // S24JAX_CUSPARSELT_FFI_SUPPORT_H_
