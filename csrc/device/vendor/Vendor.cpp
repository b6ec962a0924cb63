// Which vendor this process runs (DITORCH_VENDOR), and the page-locked host memory a vendor
// without a pinned allocator of its own hands out.
#include "device/vendor/Vendor.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <optional>
#include <sys/mman.h>

namespace ditorch {

Vendor& selectVendor(const std::string& name) {
  if (name == "emu") return emuVendor();
  // Anything else names a device type: the native vendor over it (which refuses what cannot run here).
  std::optional<c10::DeviceType> type;
  try {
    const c10::Device device(name);
    if (!device.has_index()) type = device.type();
  } catch (const c10::Error&) {
  }
  TORCH_CHECK(type && *type != c10::DeviceType::PrivateUse1, "DITORCH_VENDOR=", name,
              " is not a vendor; expected 'emu' or a device type PyTorch runs (cuda, xpu, mps, cpu, ...)");
  return nativeVendor(*type);
}

Vendor& vendor() {
  static Vendor& v = []() -> Vendor& {
    const char* env = std::getenv("DITORCH_VENDOR");
    return selectVendor(env && *env ? env : "emu");
  }();
  return v;
}

void* pageLockedAlloc(std::size_t bytes) {
  void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (p && bytes) (void)mlock(p, bytes);
  return p;
}

void pageLockedFree(void* ptr) { std::free(ptr); }

}  // namespace ditorch
