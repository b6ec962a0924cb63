// The emulated vendor: device memory is host memory, kernels are ATen's CPU kernels on the same
// storage. Kernels run synchronously on the calling thread, so every stream is always drained
// when an op returns; events and streams still keep their API contract (see Event.cpp).
#include "device/vendor/Vendor.h"

#include "device/SpeedEmulation.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <sys/mman.h>

namespace ditorch {
namespace {

constexpr std::size_t kAlignment = 64;  // cache line; ATen's CPU kernels vectorise on this

class EmuVendor final : public Vendor {
 public:
  const char* name() const override { return "emu"; }
  c10::DeviceType kernelDeviceType() const override { return c10::DeviceType::CPU; }
  bool hostAddressable() const override { return true; }
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
    return std::aligned_alloc(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  }
  void free(void* ptr, int) override { std::free(ptr); }
  void memcpy(void* dst, const void* src, std::size_t bytes, CopyKind kind, int) override {
    // A copy to the host waits for the device, as on hardware: the chip's slowness lands here.
    if (kind == CopyKind::DeviceToHost) settleEmulatedTime();
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void synchronize(int) override { settleEmulatedTime(); }
  void* mallocHost(std::size_t bytes) override {
    void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    // Page-lock like a real pinned buffer; without the privilege the buffer still works.
    if (p && bytes) (void)mlock(p, bytes);
    return p;
  }
  void freeHost(void* ptr) override { std::free(ptr); }
};

}  // namespace

Vendor& selectVendor(const std::string& name) {
  static EmuVendor emu;
  if (name == "emu") return emu;
  TORCH_CHECK(false, "unknown ditorch vendor '", name, "'; built in: emu");
}

Vendor& vendor() {
  static Vendor& v = [] () -> Vendor& {
    const char* env = std::getenv("DITORCH_VENDOR");
    return selectVendor(env ? env : "emu");
  }();
  return v;
}

}  // namespace ditorch
