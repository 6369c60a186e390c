// The cuSPARSELt handlers' scratch requests (kernels/cusparselt/scratch.h) against XLA's rule,
// without a GPU: built and run by tests/kernels/test_cusparselt_scratch.py, which checks what
// this prints (one JSON object per case).
//
// XLA's C API is faked: XLA_FFI_DeviceMemory_Allocate enforces X1 (kernels/cusparselt/rules.py:
// an alignment that is a power of two and at most S24_XLA_MAX_ALIGNMENT, else XLA's own
// "Unsupported alignment: N"), refuses more than kCapacity bytes with an out-of-memory message,
// and hands out addresses that are exactly 16-aligned but placed at 0, 16, 128 or 240 bytes past
// a 256-byte boundary (the worst cases for rounding up). The addresses are never dereferenced.
// Every request and every free is recorded. The allocator goes through the installed jaxlib's
// own ffi::ScratchAllocator (xla/ffi/api/ffi.h), decoded as the handlers decode it.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "scratch.h"

#ifndef S24_XLA_MAX_ALIGNMENT
#error "build with -DS24_XLA_MAX_ALIGNMENT=<XLA's limit, rules.XLA_MAX_SCRATCH_ALIGNMENT>"
#endif

struct XLA_FFI_Error {   // opaque in XLA's C API: the fake's own
  std::string message;
};

namespace {

constexpr std::size_t kCapacity = std::size_t{1} << 40;
constexpr std::uintptr_t kOffsets[] = {16, 0, 240, 128};

struct Request {
  std::size_t size, alignment;
  bool granted;
  std::uintptr_t block;
};
struct Free {
  std::size_t size;
  std::uintptr_t block;
};

std::vector<Request> requests;
std::vector<Free> frees;
std::uintptr_t next_boundary = std::uintptr_t{0x7f0000000000};
std::size_t handed_out = 0;

XLA_FFI_Error* Allocate(XLA_FFI_DeviceMemory_Allocate_Args* args) {
  std::size_t a = args->alignment;
  if (a == 0 || (a & (a - 1)) != 0 || a > S24_XLA_MAX_ALIGNMENT) {
    requests.push_back({args->size, a, false, 0});
    return new XLA_FFI_Error{"Unsupported alignment: " + std::to_string(a)};
  }
  if (args->size > kCapacity) {
    requests.push_back({args->size, a, false, 0});
    return new XLA_FFI_Error{"RESOURCE_EXHAUSTED: Out of memory while trying to allocate " +
                             std::to_string(args->size) + " bytes."};
  }
  std::uintptr_t block = next_boundary + kOffsets[handed_out++ % 4];
  next_boundary += ((args->size + 256 + 255) / 256) * 256;   // past the block, to a boundary
  args->data = reinterpret_cast<void*>(block);
  requests.push_back({args->size, a, true, block});
  return nullptr;
}

XLA_FFI_Error* Deallocate(XLA_FFI_DeviceMemory_Free_Args* args) {
  frees.push_back({args->size, reinterpret_cast<std::uintptr_t>(args->data)});
  return nullptr;
}

// The C API's error accessor: XLA_FFI_Error_GetMessage up to API minor 3 (jaxlib 0.10),
// XLA_FFI_Error_GetDetails (message and code) from minor 4 (jaxlib 0.11, 0.12).
#if XLA_FFI_API_MINOR >= 4
void GetDetails(XLA_FFI_Error_GetDetails_Args* args) {
  args->message = args->error->message.c_str();
  args->errc = XLA_FFI_Error_Code_INTERNAL;
}
#else
void GetMessage(XLA_FFI_Error_GetMessage_Args* args) {
  args->message = args->error->message.c_str();
}
#endif
void DestroyError(XLA_FFI_Error_Destroy_Args* args) { delete args->error; }

std::string Json(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// One handler call: a scratch allocator decoded as the handlers' context is, one buffer per
// size, released when the call ends. Prints the case as one JSON line.
void Case(const XLA_FFI_Api& api, const char* name, const std::vector<std::size_t>& sizes) {
  requests.clear();
  frees.clear();
  std::string buffers = "[";
  {
    xla::ffi::DiagnosticEngine diagnostic;
    std::optional<s24jax_cusparselt::XlaScratch> scratch =
        xla::ffi::CtxDecoding<s24jax_cusparselt::XlaScratch>::Decode(&api, nullptr, diagnostic);
    if (!scratch.has_value()) {
      std::printf("{\"case\": %s, \"decode_error\": %s}\n", Json(name).c_str(),
                  Json(diagnostic.Result()).c_str());
      return;
    }
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::size_t before = requests.size();
      s24jax_cusparselt::Scratch s =
          s24jax_cusparselt::AlignedScratch(*scratch, sizes[i], "buffer " + std::to_string(i));
      buffers += std::string(i ? ", " : "") + "{\"bytes\": " + std::to_string(sizes[i]) +
                 ", \"pointer\": " +
                 std::to_string(reinterpret_cast<std::uintptr_t>(s.data)) +
                 ", \"request\": " + (requests.size() > before ? std::to_string(before) : "null") +
                 ", \"error\": " + Json(s.error) + "}";
    }
  }   // the handler returns: XLA's allocator frees every block
  std::string reqs = "[";
  for (std::size_t i = 0; i < requests.size(); ++i)
    reqs += std::string(i ? ", " : "") + "{\"size\": " + std::to_string(requests[i].size) +
            ", \"alignment\": " + std::to_string(requests[i].alignment) +
            ", \"granted\": " + (requests[i].granted ? "true" : "false") +
            ", \"block\": " + std::to_string(requests[i].block) + "}";
  std::string fr = "[";
  for (std::size_t i = 0; i < frees.size(); ++i)
    fr += std::string(i ? ", " : "") + "{\"size\": " + std::to_string(frees[i].size) +
          ", \"block\": " + std::to_string(frees[i].block) + "}";
  std::printf("{\"case\": %s, \"buffers\": %s], \"requests\": %s], \"frees\": %s]}\n",
              Json(name).c_str(), buffers.c_str(), reqs.c_str(), fr.c_str());
}

}  // namespace

int main() {
  XLA_FFI_Api api{};
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.XLA_FFI_DeviceMemory_Allocate = Allocate;
  api.XLA_FFI_DeviceMemory_Free = Deallocate;
#if XLA_FFI_API_MINOR >= 4
  api.XLA_FFI_Error_GetDetails = GetDetails;
#else
  api.XLA_FFI_Error_GetMessage = GetMessage;
#endif
  api.XLA_FFI_Error_Destroy = DestroyError;

  // One buffer per call, of sizes around the 16- and 256-byte boundaries and beyond.
  for (std::size_t bytes : {std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{17},
                            std::size_t{240}, std::size_t{255}, std::size_t{256},
                            std::size_t{257}, std::size_t{4096}, std::size_t{1} << 20,
                            (std::size_t{3} << 30) + 5})
    Case(api, "one buffer", {bytes});
  // The algorithm search's four buffers in one call (compressed A, B, D, no workspace), as
  // GetPlan asks for them for a 256 x 512 x 128 FP8 GEMM with a float32 D.
  Case(api, "the algorithm search", {20480, 65536, 524288, 0});
  Case(api, "no bytes", {0});
  Case(api, "out of memory", {std::size_t{1} << 41});
  Case(api, "too large to pad", {std::numeric_limits<std::size_t>::max() - 10});
  return 0;
}
