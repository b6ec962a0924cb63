// The emulated vendor: device memory is host memory, kernels are ATen's CPU kernels on the same
// storage. Kernels run synchronously on the calling thread, so every stream is always drained
// when an op returns; events and streams still keep their API contract (see Event.cpp).
#include "device/vendor/Vendor.h"

#include "device/SpeedEmulation.h"
#include "device/vendor/ProtectedMemory.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <sys/mman.h>

namespace ditorch {
namespace {

constexpr std::size_t kAlignment = 64;  // cache line; ATen's CPU kernels vectorise on this

// DITORCH_EMU_PROTECT_MEMORY=1: device memory is closed to the host outside kernels (ProtectedMemory.h).
bool protectMemoryRequested() {
  const char* env = std::getenv("DITORCH_EMU_PROTECT_MEMORY");
  if (env == nullptr || std::strcmp(env, "") == 0 || std::strcmp(env, "0") == 0) return false;
  TORCH_CHECK(std::strcmp(env, "1") == 0, "DITORCH_EMU_PROTECT_MEMORY=", env, " is invalid; expected 0 or 1");
  return true;
}

// The device side of a copy, open for the copy's duration.
class OpenDuring {
 public:
  OpenDuring(ProtectedMemory* memory, const void* ptr) : memory_(memory), ptr_(ptr) {
    if (memory_) token_ = memory_->open(ptr_);
  }
  ~OpenDuring() {
    if (memory_) memory_->close(ptr_, token_);
  }
  OpenDuring(const OpenDuring&) = delete;
  OpenDuring& operator=(const OpenDuring&) = delete;

 private:
  ProtectedMemory* memory_;
  const void* ptr_;
  std::uint64_t token_ = 0;
};

class EmuVendor final : public Vendor {
 public:
  const char* name() const override { return "emu"; }
  c10::DeviceType kernelDeviceType() const override { return c10::DeviceType::CPU; }
  EmuVendor() : protected_(protectMemoryRequested() ? new ProtectedMemory() : nullptr) {}
  bool hostAddressable() const override { return protected_ == nullptr; }
  int deviceCount() const override {
    if (const char* env = std::getenv("DITORCH_EMU_DEVICES")) {
      char* end = nullptr;
      const long n = std::strtol(env, &end, 10);
      TORCH_CHECK(end != env && *end == '\0' && n >= 1 && n <= 64, "DITORCH_EMU_DEVICES=", env,
                  " is invalid; expected an integer in [1, 64]");
      return static_cast<int>(n);
    }
    return 8;
  }
  void* malloc(std::size_t bytes, int) override {
    if (protected_) return protected_->allocate(bytes);
    return std::aligned_alloc(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  }
  void free(void* ptr, int) override {
    if (protected_) protected_->free(ptr);
    else std::free(ptr);
  }
  void memcpy(void* dst, const void* src, std::size_t bytes, CopyKind kind, int) override {
    // A copy to the host waits for the device, as on hardware: the chip's slowness lands here.
    if (kind == CopyKind::DeviceToHost) settleEmulatedTime();
    if (!bytes) return;
    OpenDuring open_src(kind == CopyKind::HostToDevice ? nullptr : protected_.get(), src);
    OpenDuring open_dst(kind == CopyKind::DeviceToHost ? nullptr : protected_.get(), dst);
    std::memcpy(dst, src, bytes);
  }
  bool protectsMemory() const override { return protected_ != nullptr; }
  std::uint64_t openForKernel(const void* ptr) override { return protected_ ? protected_->open(ptr) : 0; }
  void closeAfterKernel(const void* ptr, std::uint64_t token) override {
    if (protected_) protected_->close(ptr, token);
  }
  void synchronize(int) override { settleEmulatedTime(); }
  bool redirectsKernelAllocations() const override { return true; }
  void* mallocHost(std::size_t bytes) override { return pageLockedAlloc(bytes); }
  void freeHost(void* ptr) override { pageLockedFree(ptr); }

 private:
  std::unique_ptr<ProtectedMemory> protected_;  // set when device memory is protected from the host
};

}  // namespace

Vendor& emuVendor() {
  static EmuVendor emu;
  return emu;
}

}  // namespace ditorch
