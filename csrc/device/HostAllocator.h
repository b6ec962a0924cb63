#pragma once
// Pinned host memory (page-locked through the vendor) for fast host<->device staging.
#include <c10/core/Allocator.h>

namespace ditorch {

class PinnedHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dst, const void* src, std::size_t bytes) const override;
  bool isPinned(const void* ptr) const;
};

PinnedHostAllocator& pinnedHostAllocator();

}  // namespace ditorch
