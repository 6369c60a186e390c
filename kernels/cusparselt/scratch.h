// Device scratch for the cuSPARSELt handlers (cusparselt_ffi.cc) under XLA's FFI contract.
//
// Rules that meet here (kernels/cusparselt/rules.py writes them down with their sources):
//   X1  XLA's scratch allocator (XLA_FFI_DeviceMemory_Allocate) refuses any alignment that is
//       not a power of two or is above 16 ("Unsupported alignment: 256").
//   X3  It reports a refused or failed allocation only to the diagnostic engine it was
//       decoded with, which XLA reads only when decoding a handler's operands fails.
//   R10 The handlers give cuSPARSELt 256-byte aligned scratch (the workspace, the algorithm
//       search's buffers, the compression buffer).
// So each buffer is asked as bytes + 255 at alignment 16 and the pointer rounded up to 256:
// [p, p + bytes) lies inside the block XLA gave. The block is freed by XLA's allocator when
// the handler returns. A failure comes back as a message naming the buffer, the bytes and
// alignment asked, and XLA's own words.
//
// Kept apart from the handlers so that tests/kernels/test_cusparselt_scratch.py compiles it
// alone (no CUDA, no cuSPARSELt), against a fake XLA FFI API that enforces X1.

#ifndef S24JAX_KERNELS_CUSPARSELT_SCRATCH_H_
#define S24JAX_KERNELS_CUSPARSELT_SCRATCH_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace s24jax_cusparselt {

inline constexpr std::size_t kXlaMaxScratchAlignment = 16;   // X1
inline constexpr std::size_t kScratchAlignment = 256;        // R10

// A scratch buffer, or why there is none (`error` empty on success; `data` null for 0 bytes).
struct Scratch {
  void* data = nullptr;
  std::string error;
};

// `bytes` of scratch aligned to kScratchAlignment from `allocator`, which takes alignments up
// to kXlaMaxScratchAlignment only. Allocator: std::optional<void*> Allocate(size_t bytes,
// size_t alignment), and std::string LastError(), why its last Allocate failed.
template <typename Allocator>
Scratch AlignedScratch(Allocator& allocator, std::size_t bytes, const std::string& what) {
  if (bytes == 0) return {};
  constexpr std::size_t pad = kScratchAlignment - 1;
  auto refused = [&](const std::string& asked, const std::string& why) {
    return Scratch{nullptr, "cuSPARSELt: XLA's scratch allocator could not provide " + what +
                                " (" + std::to_string(bytes) + " bytes aligned to " +
                                std::to_string(kScratchAlignment) + ", asked as " + asked +
                                "): " + why};
  };
  if (bytes > std::numeric_limits<std::size_t>::max() - pad)
    return refused("nothing", "the padded size overflows size_t");
  const std::size_t asked = bytes + pad;
  std::optional<void*> block = allocator.Allocate(asked, kXlaMaxScratchAlignment);
  if (!block.has_value() || *block == nullptr) {
    std::string why = allocator.LastError();
    return refused(std::to_string(asked) + " bytes at alignment " +
                       std::to_string(kXlaMaxScratchAlignment),
                   "XLA said: " + (why.empty() ? std::string("(no message)") : why));
  }
  const std::uintptr_t start =
      (reinterpret_cast<std::uintptr_t>(*block) + pad) & ~static_cast<std::uintptr_t>(pad);
  return {reinterpret_cast<void*>(start), {}};
}

// XLA's scratch allocator with the messages it reports kept for the handler's errors.
// ffi::ScratchAllocator::Allocate returns an empty optional on failure and writes XLA's
// message ("Failed to allocate scratch memory: ...") to the DiagnosticEngine it was decoded
// with; XLA reads that engine only when decoding the handler's operands fails, so a handler
// using the allocator XLA decodes loses the message. Decoded here (Ctx<XlaScratch>) with an
// engine of its own.
class XlaScratch {
 public:
  XlaScratch(std::unique_ptr<xla::ffi::DiagnosticEngine> engine,
             xla::ffi::ScratchAllocator allocator)
      : engine_(std::move(engine)), allocator_(std::move(allocator)) {}

  std::optional<void*> Allocate(std::size_t bytes, std::size_t alignment) {
    seen_ = engine_->Result().size();
    return allocator_.Allocate(bytes, alignment);
  }

  // What XLA reported since the last Allocate began.
  std::string LastError() const { return engine_->Result().substr(seen_); }

 private:
  // Declared first: the allocator refers to it, and reports failed frees to it when destroyed.
  std::unique_ptr<xla::ffi::DiagnosticEngine> engine_;
  xla::ffi::ScratchAllocator allocator_;
  std::size_t seen_ = 0;
};

}  // namespace s24jax_cusparselt

namespace xla::ffi {

template <>
struct CtxDecoding<s24jax_cusparselt::XlaScratch> {
  using Type = s24jax_cusparselt::XlaScratch;

  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine& diagnostic) {
    auto engine = std::make_unique<DiagnosticEngine>();
    std::optional<ScratchAllocator> allocator =
        CtxDecoding<ScratchAllocator>::Decode(api, ctx, *engine);
    if (!allocator.has_value()) {
      diagnostic.Emit("Failed to decode XLA's scratch allocator: ") << engine->Result();
      return std::nullopt;
    }
    return Type(std::move(engine), std::move(*allocator));
  }
};

}  // namespace xla::ffi

#endif  // S24JAX_KERNELS_CUSPARSELT_SCRATCH_H_
