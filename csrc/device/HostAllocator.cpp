#include "device/HostAllocator.h"

#include "device/vendor/Vendor.h"

#include <cstring>
#include <map>
#include <mutex>

namespace ditorch {
namespace {
std::mutex mu;
std::map<const char*, size_t> live;  // start -> size, to answer "is this pointer pinned?"

void freePinned(void* ptr) {
  if (!ptr) return;
  {
    std::lock_guard<std::mutex> lock(mu);
    live.erase(static_cast<const char*>(ptr));
  }
  vendor().freeHost(ptr);
}
}  // namespace

c10::DataPtr PinnedHostAllocator::allocate(size_t bytes) {
  void* ptr = bytes ? vendor().mallocHost(bytes) : nullptr;
  TORCH_CHECK_WITH(OutOfMemoryError, !bytes || ptr, "could not allocate ", bytes, " bytes of pinned host memory");
  if (ptr) {
    std::lock_guard<std::mutex> lock(mu);
    live.emplace(static_cast<const char*>(ptr), bytes);
  }
  return c10::DataPtr(ptr, ptr, &freePinned, c10::Device(c10::DeviceType::CPU));
}

c10::DeleterFnPtr PinnedHostAllocator::raw_deleter() const { return &freePinned; }

void PinnedHostAllocator::copy_data(void* dst, const void* src, std::size_t bytes) const { std::memcpy(dst, src, bytes); }

bool PinnedHostAllocator::isPinned(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu);
  auto p = static_cast<const char*>(ptr);
  auto it = live.upper_bound(p);
  if (it == live.begin()) return false;
  --it;
  return p < it->first + it->second;
}

PinnedHostAllocator& pinnedHostAllocator() {
  static PinnedHostAllocator allocator;
  return allocator;
}

}  // namespace ditorch
