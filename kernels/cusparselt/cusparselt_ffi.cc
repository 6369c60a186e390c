// cuSPARSELt 2:4 sparse GEMMs as XLA FFI custom calls (s24jax.kernels.cusparselt).
//
// Three handlers, one GEMM convention. Every matrix is described column-major, so that JAX's
// row-major arrays need no copy: a row-major (R, C) array is the column-major (C, R) matrix.
//
//   cusparselt_compress(A dense) -> A compressed          (by A's descriptor alone)
//   cusparselt_spmm(A compressed, B) -> D                  D = op(A) op(B), D (m, n)
//   cusparselt_search(A compressed, B) -> int32[5]         the library's best algorithm
//
// op(A) is m x k and 2:4 along k (its contraction dimension), op(B) is k x n; `trans_a` /
// `trans_b` say whether the stored column-major matrix is op(X)^T; `d_row_major` stores D
// row-major instead (whether cuSPARSELt accepts it for every dtype is only known on a GPU).
//
// Compression makes no plan: the compressed layout depends on A's structured descriptor, the
// operation and the GPU, not on the algorithm (cusparseLtSpMMACompress2 takes no plan;
// PyTorch's _cslt_compress uses it before any algorithm is chosen and multiplies the result
// under any alg id). Its size must fit the buffer the trace reserves (rules.py, R9), or the
// handler stops naming both sizes. The algorithm is part of the GEMM: spmm's attributes
// alg_id, split_k, split_k_mode, split_k_buffers are set on the default selection before
// cusparseLtMatmulPlanInit, and the plan cache's key includes them. Only cusparselt_search
// runs cusparseLtMatmulSearch.
//
// Handles, descriptors and plans are per thread (and per device within a thread):
// cuSPARSELt handles must not be shared across threads (NVIDIA's advice, relayed in
// pytorch/pytorch#113776; PyTorch keeps a thread-local handle per device since #114273), and
// with nothing shared there is no lock, so one device's algorithm search never stalls
// another's GEMMs. Scratch comes from XLA's allocator, 256-byte aligned under XLA's limit of
// 16 (scratch.h; rules.py, R10, X1, X3); all work runs on XLA's stream. Every cuSPARSELt,
// CUDA or XLA failure comes back as an FFI error naming the call and carrying the other
// side's own message; nothing aborts the process.
//
// Never run on a GPU (written from the cuSPARSELt 0.10.0 header; built, registered and
// compiled into deviceless H100 executables without one): the descriptor-based compression,
// the algorithm attributes, cusparselt_search and its copy of the result.
// Build: s24jax/kernels/cusparselt/library.py (g++, no nvcc: cuSPARSELt is a host API).

#include <cuda_runtime_api.h>
#include <cusparseLt.h>
#include <dlfcn.h>

#include <array>
#include <climits>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "ffi_support.h"
#include "scratch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using s24jax_cusparselt::AlignedScratch;
using s24jax_cusparselt::CudaType;
using s24jax_cusparselt::ElementBytes;
using s24jax_cusparselt::Op;
using s24jax_cusparselt::Status;
using s24jax_cusparselt::TypeNamed;
using s24jax_cusparselt::XlaScratch;

namespace {

// An algorithm as spmm's attributes carry it (algorithms.Algorithm's fields), and the
// library's attribute for each.
using Algorithm = std::array<int64_t, 4>;
constexpr const char* kAlgorithmNames[] = {"alg_id", "split_k", "split_k_mode",
                                           "split_k_buffers"};
constexpr cusparseLtMatmulAlgAttribute_t kAlgorithmAttributes[] = {
    CUSPARSELT_MATMUL_ALG_CONFIG_ID, CUSPARSELT_MATMUL_SPLIT_K, CUSPARSELT_MATMUL_SPLIT_K_MODE,
    CUSPARSELT_MATMUL_SPLIT_K_BUFFERS};
// algorithms.DEFAULT, the library's default selection. A value at or below one of these
// leaves that attribute at the library's choice (PyTorch, too, sets split-K only when not 1).
constexpr Algorithm kDefault{-1, 1, 0, 1};

// One GEMM with its algorithm: the plan cache's key.
struct Gemm {
  int device;
  int64_t m, n, k;
  int a_type, b_type, d_type;
  bool trans_a, trans_b, d_row_major;
  Algorithm alg;
  auto Tied() const {
    return std::tie(device, m, n, k, a_type, b_type, d_type, trans_a, trans_b, d_row_major,
                    alg);
  }
  bool operator<(const Gemm& o) const { return Tied() < o.Tied(); }
};

struct Plan {
  cusparseLtHandle_t* handle = nullptr;   // the device's (owned by `handles`)
  cusparseLtMatDescriptor_t a, b, d;
  cusparseLtMatmulDescriptor_t matmul;
  cusparseLtMatmulAlgSelection_t alg;
  cusparseLtMatmulPlan_t plan;
  size_t workspace = 0;
};

// A's structured descriptor for compression, by (device, m, k, A's type, trans_a).
using SparseAKey = std::tuple<int, int64_t, int64_t, int, bool>;

// Per thread: one handle per device, and the descriptors and plans made on them. Never freed
// (nor is what a failed InitPlan made): a pointer to one stays valid for the thread's life.
thread_local std::map<int, std::unique_ptr<cusparseLtHandle_t>> handles;
thread_local std::map<SparseAKey, std::unique_ptr<cusparseLtMatDescriptor_t>> sparse_as;
thread_local std::map<Gemm, std::unique_ptr<Plan>> plans;

// The calling thread's handle on `device`, which is made current first.
ffi::Error HandleFor(int device, cusparseLtHandle_t** out) {
  S24_CUDA(cudaSetDevice(device));
  auto it = handles.find(device);
  if (it == handles.end()) {
    auto handle = std::make_unique<cusparseLtHandle_t>();
    S24_CUSPARSELT(cusparseLtInit(handle.get()));
    it = handles.emplace(device, std::move(handle)).first;
  }
  *out = it->second.get();
  return ffi::Error::Success();
}

// `bytes` of 256-byte aligned scratch (nullptr for 0 bytes), or the error naming `what`, the
// bytes and alignment asked and XLA's message (scratch.h).
ffi::Error Scratch(XlaScratch& scratch, size_t bytes, const char* what, void** out) {
  s24jax_cusparselt::Scratch s = AlignedScratch(scratch, bytes, what);
  if (!s.error.empty()) return ffi::Error::Internal(std::move(s.error));
  *out = s.data;
  return ffi::Error::Success();
}

// A GEMM from a handler's attributes and element types, or what is unsupported in it.
ffi::Error MakeGemm(int device, int64_t m, int64_t n, int64_t k, ffi::DataType a,
                    ffi::DataType b, ffi::DataType d, bool trans_a, bool trans_b,
                    bool d_row_major, Algorithm alg, Gemm* out) {
  auto at = CudaType(a), bt = CudaType(b), dt = CudaType(d);
  for (const auto* t : {&at, &bt, &dt})
    if (t->has_error()) return t->error();
  if (k % 4)
    return ffi::Error::InvalidArgument("cuSPARSELt: the contraction dimension k=" +
                                       std::to_string(k) +
                                       " must be a multiple of 4 (2:4 groups along it)");
  *out = Gemm{device, m, n, k, *at, *bt, *dt, trans_a, trans_b, d_row_major, alg};
  return ffi::Error::Success();
}

// The stored A, column-major: op(A) (m x k) or, with trans_a, its transpose (k x m).
ffi::Error DescribeA(const Gemm& g, cusparseLtHandle_t* h, cusparseLtMatDescriptor_t* a) {
  int64_t rows = g.trans_a ? g.k : g.m, cols = g.trans_a ? g.m : g.k;
  S24_CUSPARSELT(cusparseLtStructuredDescriptorInit(h, a, rows, cols, rows, 16,
                                                    (cudaDataType)g.a_type, CUSPARSE_ORDER_COL,
                                                    CUSPARSELT_SPARSITY_50_PERCENT));
  return ffi::Error::Success();
}

// `g`'s algorithm on a default selection (the library's attributes are C ints).
ffi::Error SetAlgorithm(const Gemm& g, cusparseLtHandle_t* h,
                        cusparseLtMatmulAlgSelection_t* selection) {
  for (size_t i = 0; i < g.alg.size(); ++i) {
    if (g.alg[i] <= kDefault[i]) continue;
    int value = static_cast<int>(g.alg[i]);
    cusparseStatus_t s = g.alg[i] > INT_MAX ? CUSPARSE_STATUS_INVALID_VALUE
                         : cusparseLtMatmulAlgSetAttribute(h, selection, kAlgorithmAttributes[i],
                                                           &value, sizeof(value));
    if (s != CUSPARSE_STATUS_SUCCESS)
      return ffi::Error::InvalidArgument(Status("cusparseLtMatmulAlgSetAttribute", s) + " for " +
                                         kAlgorithmNames[i] + "=" + std::to_string(g.alg[i]));
  }
  return ffi::Error::Success();
}

// `p`'s descriptors, algorithm selection (the default, then `g`'s attributes) and plan.
ffi::Error InitPlan(const Gemm& g, cusparseLtHandle_t* h, Plan* p) {
  p->handle = h;
  int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  S24_RETURN_IF_ERROR(DescribeA(g, h, &p->a));
  S24_CUSPARSELT(cusparseLtDenseDescriptorInit(h, &p->b, b_rows, b_cols, b_rows, 16,
                                               (cudaDataType)g.b_type, CUSPARSE_ORDER_COL));
  S24_CUSPARSELT(cusparseLtDenseDescriptorInit(
      h, &p->d, g.m, g.n, g.d_row_major ? g.n : g.m, 16, (cudaDataType)g.d_type,
      g.d_row_major ? CUSPARSE_ORDER_ROW : CUSPARSE_ORDER_COL));
  S24_CUSPARSELT(cusparseLtMatmulDescriptorInit(h, &p->matmul, Op(g.trans_a), Op(g.trans_b),
                                                &p->a, &p->b, &p->d, &p->d,
                                                CUSPARSE_COMPUTE_32F));
  S24_CUSPARSELT(cusparseLtMatmulAlgSelectionInit(h, &p->alg, &p->matmul,
                                                  CUSPARSELT_MATMUL_ALG_DEFAULT));
  S24_RETURN_IF_ERROR(SetAlgorithm(g, h, &p->alg));
  S24_CUSPARSELT(cusparseLtMatmulPlanInit(h, &p->plan, &p->matmul, &p->alg));
  S24_CUSPARSELT(cusparseLtMatmulGetWorkspace(h, &p->plan, &p->workspace));
  return ffi::Error::Success();
}

// The plan of `g` on this thread, made on first use.
ffi::Error PlanFor(const Gemm& g, Plan** out) {
  cusparseLtHandle_t* handle = nullptr;
  S24_RETURN_IF_ERROR(HandleFor(g.device, &handle));
  auto it = plans.find(g);
  if (it == plans.end()) {
    auto p = std::make_unique<Plan>();
    S24_RETURN_IF_ERROR(InitPlan(g, handle, p.get()));
    it = plans.emplace(g, std::move(p)).first;
  }
  *out = it->second.get();
  return ffi::Error::Success();
}

ffi::Error Compress(cudaStream_t stream, XlaScratch scratch, int32_t device,
                    ffi::AnyBuffer dense, ffi::Result<ffi::AnyBuffer> compressed, int64_t m,
                    int64_t n, int64_t k, bool trans_a, bool trans_b, bool d_row_major,
                    std::string_view b_dtype, std::string_view d_dtype) {
  // The whole GEMM is checked, but only A's shape, type and trans_a shape its compression.
  Gemm g;
  S24_RETURN_IF_ERROR(MakeGemm(device, m, n, k, dense.element_type(), TypeNamed(b_dtype),
                               TypeNamed(d_dtype), trans_a, trans_b, d_row_major, kDefault,
                               &g));
  cusparseLtHandle_t* h = nullptr;
  S24_RETURN_IF_ERROR(HandleFor(device, &h));
  auto& a = sparse_as[SparseAKey{device, m, k, g.a_type, trans_a}];
  if (!a) {
    auto described = std::make_unique<cusparseLtMatDescriptor_t>();
    S24_RETURN_IF_ERROR(DescribeA(g, h, described.get()));
    a = std::move(described);
  }
  size_t bytes = 0, buffer_bytes = 0;
  S24_CUSPARSELT(cusparseLtSpMMACompressedSize2(h, a.get(), &bytes, &buffer_bytes));
  if (bytes > compressed->size_bytes()) {
    return ffi::Error::Internal(
        "cuSPARSELt: the compressed operand needs " + std::to_string(bytes) +
        " bytes, more than the " + std::to_string(compressed->size_bytes()) +
        " the trace reserved (kernels/cusparselt/rules.py, R9: 9/16 of the dense bytes for "
        "16-bit types, 10/16 for 8-bit); raise the bound there (compressed_bytes)");
  }
  void* buffer = nullptr;
  S24_RETURN_IF_ERROR(Scratch(scratch, buffer_bytes, "the compression buffer", &buffer));
  S24_CUSPARSELT(cusparseLtSpMMACompress2(h, a.get(), /*isSparseA=*/1, Op(trans_a),
                                          dense.untyped_data(), compressed->untyped_data(),
                                          buffer, stream));
  return ffi::Error::Success();
}

ffi::Error Spmm(cudaStream_t stream, XlaScratch scratch, int32_t device, ffi::AnyBuffer a,
                ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> d, int64_t m, int64_t n,
                int64_t k, bool trans_a, bool trans_b, bool d_row_major,
                std::string_view a_dtype, int64_t alg_id, int64_t split_k,
                int64_t split_k_mode, int64_t split_k_buffers) {
  Gemm g;
  S24_RETURN_IF_ERROR(MakeGemm(device, m, n, k, TypeNamed(a_dtype), b.element_type(),
                               d->element_type(), trans_a, trans_b, d_row_major,
                               {alg_id, split_k, split_k_mode, split_k_buffers}, &g));
  Plan* p = nullptr;
  S24_RETURN_IF_ERROR(PlanFor(g, &p));
  void* workspace = nullptr;
  S24_RETURN_IF_ERROR(Scratch(scratch, p->workspace, "the matmul workspace", &workspace));
  float alpha = 1.0f, beta = 0.0f;
  S24_CUSPARSELT(cusparseLtMatmul(p->handle, &p->plan, &alpha, a.untyped_data(),
                                  b.untyped_data(), &beta, d->untyped_data(),
                                  d->untyped_data(), workspace, &stream, 1));
  return ffi::Error::Success();
}

// What cusparselt_search returns: the algorithm's 4 attributes, then the number of algorithm
// ids (algorithms.py reads them in this order).
constexpr size_t kSearchResultSize = std::tuple_size_v<Algorithm> + 1;

// The library's best algorithm for a GEMM: cusparseLtMatmulSearch times every candidate by
// running it on the call's operands (D and the workspace in scratch: the workspace of the
// default selection's plan, as PyTorch and NVIDIA's samples give it), and leaves the fastest
// in the plan's algorithm selection, which is read back from there. The plan is this call's
// own, made from the default selection and destroyed at the end: spmm's plan for the default
// must keep the library's default.
ffi::Error Search(cudaStream_t stream, XlaScratch scratch, int32_t device, ffi::AnyBuffer a,
                  ffi::AnyBuffer b, ffi::Result<ffi::Buffer<ffi::S32>> result, int64_t m,
                  int64_t n, int64_t k, bool trans_a, bool trans_b, bool d_row_major,
                  std::string_view a_dtype, std::string_view d_dtype) {
  if (result->element_count() != kSearchResultSize)
    return ffi::Error::InvalidArgument("cuSPARSELt search: the result must be int32[" +
                                       std::to_string(kSearchResultSize) + "]");
  Gemm g;
  S24_RETURN_IF_ERROR(MakeGemm(device, m, n, k, TypeNamed(a_dtype), b.element_type(),
                               TypeNamed(d_dtype), trans_a, trans_b, d_row_major, kDefault,
                               &g));
  cusparseLtHandle_t* h = nullptr;
  S24_RETURN_IF_ERROR(HandleFor(device, &h));
  Plan p;
  S24_RETURN_IF_ERROR(InitPlan(g, h, &p));
  struct Destroy {
    Plan& p;
    ~Destroy() {
      cusparseLtMatmulPlanDestroy(&p.plan);
      cusparseLtMatmulAlgSelectionDestroy(&p.alg);
      for (auto* descriptor : {&p.a, &p.b, &p.d}) cusparseLtMatDescriptorDestroy(descriptor);
    }
  } destroy{p};
  void *d = nullptr, *workspace = nullptr;
  S24_RETURN_IF_ERROR(Scratch(scratch, size_t(m) * n * ElementBytes(g.d_type), "the search's D",
                              &d));
  S24_RETURN_IF_ERROR(Scratch(scratch, p.workspace, "the search's workspace", &workspace));
  float alpha = 1.0f, beta = 0.0f;
  S24_CUSPARSELT(cusparseLtMatmulSearch(h, &p.plan, &alpha, a.untyped_data(), b.untyped_data(),
                                        &beta, d, d, workspace, &stream, 1));
  int32_t found[kSearchResultSize];   // the library's attributes are C ints
  for (size_t i = 0; i < kSearchResultSize; ++i) {
    bool max_id = i == kSearchResultSize - 1;
    S24_CUSPARSELT(cusparseLtMatmulAlgGetAttribute(
        h, &p.alg, max_id ? CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID : kAlgorithmAttributes[i],
        &found[i], sizeof(found[i])));
  }
  // `found` lives in this frame, and cudaMemcpyAsync from pageable host memory may return
  // before the copy has read it: synchronizing XLA's stream before returning makes the array
  // outlive the copy. The wait costs little: the search has just waited for its own timings,
  // and it runs once per GEMM, outside a training step. (XLA puts no handler without a
  // command-buffer trait, as this one, into a CUDA graph, where a synchronize is illegal.)
  S24_CUDA(cudaMemcpyAsync(result->typed_data(), found, sizeof(found), cudaMemcpyHostToDevice,
                           stream));
  S24_CUDA(cudaStreamSynchronize(stream));
  return ffi::Error::Success();
}

}  // namespace

// The handlers' context: XLA's stream, its scratch allocator (with its messages kept:
// scratch.h), the device.
auto WithContext() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<XlaScratch>()
      .Ctx<ffi::DeviceOrdinal>();
}

// The GEMM's attributes, shared by the handlers.
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
        .Attr<std::string_view>("a_dtype")
        .Attr<int64_t>("alg_id")
        .Attr<int64_t>("split_k")
        .Attr<int64_t>("split_k_mode")
        .Attr<int64_t>("split_k_buffers"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CusparseltSearch, Search,
    GemmAttrs(WithContext()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Ret<ffi::Buffer<ffi::S32>>())
        .Attr<std::string_view>("a_dtype")
        .Attr<std::string_view>("d_dtype"));

// Which libcusparseLt serves the handlers (library.serving()): its version, from
// cusparseLtGetProperty (a static query: no handle, no GPU), and the file that provides
// cusparseLtGetProperty to this library (dladdr of the address the dynamic linker bound: in
// one process the first libcusparseLt.so.0 loaded serves everything that links it, e.g.
// torch's own copy if torch was imported first). A plain C function, not a handler. Returns
// 0; else the status of a failed query, -1 if dladdr names no file, -2 if the file's name
// and its NUL do not fit in `path_len` bytes.
extern "C" int S24jaxCusparseltLibrary(char* path, int path_len, int* major, int* minor,
                                       int* patch) {
  const std::pair<libraryPropertyType, int*> properties[] = {
      {MAJOR_VERSION, major}, {MINOR_VERSION, minor}, {PATCH_LEVEL, patch}};
  for (const auto& [property, value] : properties) {
    cusparseStatus_t s = cusparseLtGetProperty(property, value);
    if (s != CUSPARSE_STATUS_SUCCESS) return static_cast<int>(s);
  }
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&cusparseLtGetProperty), &info) == 0 ||
      info.dli_fname == nullptr)
    return -1;
  size_t length = std::strlen(info.dli_fname);
  if (path_len < 0 || length + 1 > static_cast<size_t>(path_len)) return -2;
  std::memcpy(path, info.dli_fname, length + 1);
  return 0;
}
