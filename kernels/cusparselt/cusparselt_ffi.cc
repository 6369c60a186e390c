// cuSPARSELt 2:4 sparse GEMMs as XLA FFI custom calls (s24jax.kernels.cusparselt).
//
// Two handlers, one GEMM convention. Every matrix is described column-major, so that JAX's
// row-major arrays need no copy: a row-major (R, C) array is the column-major (C, R) matrix.
//
//   cusparselt_compress(A dense) -> A compressed          (under the plan of the GEMM below)
//   cusparselt_spmm(A compressed, B) -> D                  D = op(A) op(B), D (m, n)
//
// op(A) is m x k and 2:4 along k (its contraction dimension), op(B) is k x n; `trans_a` /
// `trans_b` say whether the stored column-major matrix is op(X)^T; `d_row_major` stores D
// row-major instead (an attribute: whether cuSPARSELt accepts it for every dtype is only
// known on a GPU). Both handlers find the same plan, cached per (device, m, n, k, dtypes,
// transposes, D's order); its algorithm is chosen once, by cusparseLtMatmulSearch on scratch
// buffers, when the plan is made (the compressed layout depends on it: compress and multiply
// under one plan). Handles and plans are per thread (and per device within a thread):
// cuSPARSELt handles must not be shared across threads (NVIDIA's advice, relayed in
// pytorch/pytorch#113776; PyTorch keeps a thread-local handle per device since #114273), and
// with nothing shared there is no lock, so one device's algorithm search never stalls
// another's GEMMs. Workspace and compression buffers come from XLA's scratch allocator,
// 256-byte aligned under XLA's limit of 16 (scratch.h; rules.py, R10, X1, X3); all work runs on
// XLA's stream. Every cuSPARSELt, CUDA or XLA failure comes back as an FFI error naming the
// call and carrying the other side's own message (the library's status name and text, CUDA's
// error, XLA's allocator message); nothing aborts the process.
//
// The compressed output has the size rules.py gives (R9: 9/16 of the dense A's bytes for
// 16-bit types, 10/16 for 8-bit: half the values and 2 bits per kept value), known without a
// GPU at trace time; the handler checks the library's own size against it and stops with an
// error naming both if it does not fit.
//
// Build: s24jax/kernels/cusparselt/library.py (g++, no nvcc: cuSPARSELt is a host API).

#include <cuda_runtime_api.h>
#include <cusparseLt.h>

#include <cstdint>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "scratch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using s24jax_cusparselt::AlignedScratch;
using s24jax_cusparselt::XlaScratch;

namespace {

std::string Status(const char* call, cusparseStatus_t status) {
  std::ostringstream out;
  out << "cuSPARSELt: " << call << " failed with status " << static_cast<int>(status) << " ("
      << cusparseLtGetErrorName(status) << ": " << cusparseLtGetErrorString(status)
      << "; CUSPARSELT_LOG_LEVEL=1 prints the library's reason)";
  return out.str();
}

#define S24_CUSPARSELT(call)                                        \
  do {                                                              \
    cusparseStatus_t s24_status = (call);                           \
    if (s24_status != CUSPARSE_STATUS_SUCCESS)                      \
      return ffi::Error::Internal(Status(#call, s24_status));       \
  } while (0)

ffi::ErrorOr<cudaDataType> CudaType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return CUDA_R_16BF;
    case ffi::DataType::F16: return CUDA_R_16F;
    case ffi::DataType::F32: return CUDA_R_32F;
    case ffi::DataType::F8E4M3FN: return CUDA_R_8F_E4M3;
    case ffi::DataType::F8E5M2: return CUDA_R_8F_E5M2;
    default:
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          "cuSPARSELt: unsupported element type " + std::to_string(static_cast<int>(t)) +
          " (bf16, f16: sm_80+; e4m3, e5m2: sm_90+)"));
  }
}

struct Key {
  int device;
  int64_t m, n, k;
  int a_type, b_type, d_type;
  bool trans_a, trans_b, d_row_major;
  bool operator<(const Key& o) const {
    return std::tie(device, m, n, k, a_type, b_type, d_type, trans_a, trans_b, d_row_major) <
           std::tie(o.device, o.m, o.n, o.k, o.a_type, o.b_type, o.d_type, o.trans_a,
                    o.trans_b, o.d_row_major);
  }
};

struct Plan {
  cusparseLtHandle_t* handle = nullptr;   // the device's (owned by `handles`)
  cusparseLtMatDescriptor_t a, b, d;
  cusparseLtMatmulDescriptor_t matmul;
  cusparseLtMatmulAlgSelection_t alg;
  cusparseLtMatmulPlan_t plan;
  size_t workspace = 0, compressed = 0, compress_buffer = 0;
};

// Per thread: one handle per device, and the plans made on them.
thread_local std::map<int, std::unique_ptr<cusparseLtHandle_t>> handles;
thread_local std::map<Key, std::unique_ptr<Plan>> plans;

ffi::ErrorOr<cusparseLtHandle_t*> Handle(int device) {
  auto it = handles.find(device);
  if (it != handles.end()) return it->second.get();
  auto handle = std::make_unique<cusparseLtHandle_t>();
  cusparseStatus_t s = cusparseLtInit(handle.get());
  if (s != CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(ffi::Error::Internal(Status("cusparseLtInit", s)));
  return (handles[device] = std::move(handle)).get();
}

// `bytes` of 256-byte aligned scratch (nullptr for 0 bytes), or the error naming `what`, the
// bytes and alignment asked and XLA's message (scratch.h).
ffi::ErrorOr<void*> Scratch(XlaScratch& scratch, size_t bytes, const char* what) {
  s24jax_cusparselt::Scratch s = AlignedScratch(scratch, bytes, what);
  if (!s.error.empty()) return ffi::Unexpected(ffi::Error::Internal(std::move(s.error)));
  return s.data;
}

// The plan of `key` on this thread, made (and its algorithm searched) on first use.
ffi::ErrorOr<Plan*> GetPlan(const Key& key, cudaStream_t stream,
                            XlaScratch& scratch) {
  auto it = plans.find(key);
  if (it != plans.end()) return it->second.get();
  auto h = Handle(key.device);
  if (h.has_error()) return ffi::Unexpected(h.error());
  cusparseLtHandle_t* handle = *h;
  auto p = std::make_unique<Plan>();
  p->handle = handle;
  // Column-major descriptions: stored A is op(A) (m x k) or its transpose (k x m).
  int64_t a_rows = key.trans_a ? key.k : key.m, a_cols = key.trans_a ? key.m : key.k;
  int64_t b_rows = key.trans_b ? key.n : key.k, b_cols = key.trans_b ? key.k : key.n;
  cusparseOrder_t col = CUSPARSE_ORDER_COL;
  cusparseOrder_t d_order = key.d_row_major ? CUSPARSE_ORDER_ROW : CUSPARSE_ORDER_COL;
  int64_t d_ld = key.d_row_major ? key.n : key.m;
  auto err = [&](const char* call, cusparseStatus_t s) -> ffi::Error {
    return ffi::Error::Internal(Status(call, s));
  };
  cusparseStatus_t s;
  if ((s = cusparseLtStructuredDescriptorInit(
           handle, &p->a, a_rows, a_cols, a_rows, 16, (cudaDataType)key.a_type, col,
           CUSPARSELT_SPARSITY_50_PERCENT)) != CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(err("cusparseLtStructuredDescriptorInit", s));
  if ((s = cusparseLtDenseDescriptorInit(handle, &p->b, b_rows, b_cols, b_rows, 16,
                                         (cudaDataType)key.b_type, col)) !=
      CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(err("cusparseLtDenseDescriptorInit(B)", s));
  if ((s = cusparseLtDenseDescriptorInit(handle, &p->d, key.m, key.n, d_ld, 16,
                                         (cudaDataType)key.d_type, d_order)) !=
      CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(err("cusparseLtDenseDescriptorInit(D)", s));
  cusparseOperation_t op_a = key.trans_a ? CUSPARSE_OPERATION_TRANSPOSE
                                         : CUSPARSE_OPERATION_NON_TRANSPOSE;
  cusparseOperation_t op_b = key.trans_b ? CUSPARSE_OPERATION_TRANSPOSE
                                         : CUSPARSE_OPERATION_NON_TRANSPOSE;
  if ((s = cusparseLtMatmulDescriptorInit(handle, &p->matmul, op_a, op_b, &p->a, &p->b, &p->d,
                                          &p->d, CUSPARSE_COMPUTE_32F)) !=
      CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(err("cusparseLtMatmulDescriptorInit", s));
  if ((s = cusparseLtMatmulAlgSelectionInit(handle, &p->alg, &p->matmul,
                                            CUSPARSELT_MATMUL_ALG_DEFAULT)) !=
      CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(err("cusparseLtMatmulAlgSelectionInit", s));
  if ((s = cusparseLtMatmulPlanInit(handle, &p->plan, &p->matmul, &p->alg)) !=
      CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(err("cusparseLtMatmulPlanInit", s));
  // The algorithm, once per plan: cusparseLtMatmulSearch times the candidates on buffers of
  // the GEMM's shapes (their contents do not matter for timing).
  size_t workspace = 0;
  if ((s = cusparseLtMatmulGetWorkspace(handle, &p->plan, &workspace)) !=
      CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(err("cusparseLtMatmulGetWorkspace", s));
  size_t a_bytes = 0, a_buffer = 0;
  if ((s = cusparseLtSpMMACompressedSize(handle, &p->plan, &a_bytes, &a_buffer)) !=
      CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(err("cusparseLtSpMMACompressedSize", s));
  size_t elem_b = key.b_type == CUDA_R_16BF || key.b_type == CUDA_R_16F ? 2
                  : key.b_type == CUDA_R_32F ? 4 : 1;
  size_t elem_d = key.d_type == CUDA_R_16BF || key.d_type == CUDA_R_16F ? 2
                  : key.d_type == CUDA_R_32F ? 4 : 1;
  auto sa = Scratch(scratch, a_bytes, "the algorithm search's compressed A");
  if (sa.has_error()) return ffi::Unexpected(sa.error());
  auto sb = Scratch(scratch, size_t(key.k) * key.n * elem_b, "the algorithm search's B");
  if (sb.has_error()) return ffi::Unexpected(sb.error());
  auto sd = Scratch(scratch, size_t(key.m) * key.n * elem_d, "the algorithm search's D");
  if (sd.has_error()) return ffi::Unexpected(sd.error());
  auto sw = Scratch(scratch, workspace, "the algorithm search's workspace");
  if (sw.has_error()) return ffi::Unexpected(sw.error());
  float alpha = 1.0f, beta = 0.0f;
  if ((s = cusparseLtMatmulSearch(handle, &p->plan, &alpha, *sa, *sb, &beta, *sd, *sd, *sw,
                                  &stream, 1)) != CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(err("cusparseLtMatmulSearch", s));
  // The search may pick an algorithm with other needs: ask again.
  if ((s = cusparseLtMatmulGetWorkspace(handle, &p->plan, &p->workspace)) !=
      CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(err("cusparseLtMatmulGetWorkspace", s));
  if ((s = cusparseLtSpMMACompressedSize(handle, &p->plan, &p->compressed,
                                         &p->compress_buffer)) != CUSPARSE_STATUS_SUCCESS)
    return ffi::Unexpected(err("cusparseLtSpMMACompressedSize", s));
  return (plans[key] = std::move(p)).get();
}

ffi::ErrorOr<Key> MakeKey(int device, int64_t m, int64_t n, int64_t k, ffi::DataType a,
                          ffi::DataType b, ffi::DataType d, bool trans_a, bool trans_b,
                          bool d_row_major) {
  auto at = CudaType(a), bt = CudaType(b), dt = CudaType(d);
  if (at.has_error()) return ffi::Unexpected(at.error());
  if (bt.has_error()) return ffi::Unexpected(bt.error());
  if (dt.has_error()) return ffi::Unexpected(dt.error());
  if (k % 4)
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "cuSPARSELt: the contraction dimension k=" + std::to_string(k) +
        " must be a multiple of 4 (2:4 groups along it)"));
  return Key{device, m, n, k, int(*at), int(*bt), int(*dt), trans_a, trans_b, d_row_major};
}

// The dtype attributes' names (ops.py: _DTYPE_NAMES) -> XLA's element types.
ffi::DataType TypeNamed(std::string_view name) {
  if (name == "bf16") return ffi::DataType::BF16;
  if (name == "f16") return ffi::DataType::F16;
  if (name == "e4m3") return ffi::DataType::F8E4M3FN;
  if (name == "e5m2") return ffi::DataType::F8E5M2;
  return ffi::DataType::F32;
}

// The plan of a GEMM (made on first use), on `device`, for the calling thread. Plans are
// never freed, so the pointer stays valid for the thread's life.
ffi::ErrorOr<Plan*> PlanFor(const ffi::ErrorOr<Key>& key, int32_t device, cudaStream_t stream,
                            XlaScratch& scratch) {
  if (key.has_error()) return ffi::Unexpected(key.error());
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess)
    return ffi::Unexpected(ffi::Error::Internal(std::string("CUDA: cudaSetDevice failed: ") +
                                                cudaGetErrorName(err) + ": " +
                                                cudaGetErrorString(err)));
  return GetPlan(*key, stream, scratch);
}

ffi::Error Compress(cudaStream_t stream, XlaScratch scratch, int32_t device,
                    ffi::AnyBuffer dense, ffi::Result<ffi::AnyBuffer> compressed, int64_t m,
                    int64_t n, int64_t k, bool trans_a, bool trans_b, bool d_row_major,
                    std::string_view b_dtype, std::string_view d_dtype) {
  auto plan = PlanFor(MakeKey(device, m, n, k, dense.element_type(), TypeNamed(b_dtype),
                             TypeNamed(d_dtype), trans_a, trans_b, d_row_major),
                     device, stream, scratch);
  if (plan.has_error()) return plan.error();
  Plan* p = *plan;
  if (p->compressed > compressed->size_bytes()) {
    return ffi::Error::Internal(
        "cuSPARSELt: the compressed operand needs " + std::to_string(p->compressed) +
        " bytes, more than the " + std::to_string(compressed->size_bytes()) +
        " the trace reserved (kernels/cusparselt/rules.py, R9: 9/16 of the dense bytes for "
        "16-bit types, 10/16 for 8-bit); raise the bound there (compressed_bytes)");
  }
  auto buffer = Scratch(scratch, p->compress_buffer, "the compression buffer");
  if (buffer.has_error()) return buffer.error();
  S24_CUSPARSELT(cusparseLtSpMMACompress(p->handle, &p->plan, dense.untyped_data(),
                                         compressed->untyped_data(), *buffer, stream));
  return ffi::Error::Success();
}

ffi::Error Spmm(cudaStream_t stream, XlaScratch scratch, int32_t device,
                ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> d, int64_t m,
                int64_t n, int64_t k, bool trans_a, bool trans_b, bool d_row_major,
                std::string_view a_dtype) {
  auto plan = PlanFor(MakeKey(device, m, n, k, TypeNamed(a_dtype), b.element_type(),
                             d->element_type(), trans_a, trans_b, d_row_major),
                     device, stream, scratch);
  if (plan.has_error()) return plan.error();
  Plan* p = *plan;
  auto workspace = Scratch(scratch, p->workspace, "the matmul workspace");
  if (workspace.has_error()) return workspace.error();
  float alpha = 1.0f, beta = 0.0f;
  S24_CUSPARSELT(cusparseLtMatmul(p->handle, &p->plan, &alpha, a.untyped_data(),
                                  b.untyped_data(), &beta, d->untyped_data(),
                                  d->untyped_data(), *workspace, &stream, 1));
  return ffi::Error::Success();
}

}  // namespace

// Both handlers' context: XLA's stream, its scratch allocator (with its messages kept:
// scratch.h), the device.
auto WithContext() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<XlaScratch>()
      .Ctx<ffi::DeviceOrdinal>();
}

// The GEMM's attributes, shared by both handlers (the same plan key).
template <typename Binding>
auto GemmAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("m")
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("k")
      .template Attr<bool>("trans_a")
      .template Attr<bool>("trans_b")
      .template Attr<bool>("d_row_major");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CusparseltCompress, Compress,
    GemmAttrs(WithContext().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>())
        .Attr<std::string_view>("b_dtype")
        .Attr<std::string_view>("d_dtype"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CusparseltSpmm, Spmm,
    GemmAttrs(WithContext().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>())
        .Attr<std::string_view>("a_dtype"));
