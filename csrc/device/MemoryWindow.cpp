#include "device/MemoryWindow.h"

#include "device/vendor/Vendor.h"

namespace ditorch {
namespace {

bool memoryProtected() {
  static const bool on = vendor().protectsMemory();
  return on;
}

thread_local MemoryWindow* t_current = nullptr;

}  // namespace

MemoryWindow::MemoryWindow() : active_(memoryProtected()) {
  if (!active_) return;
  previous_ = t_current;
  t_current = this;
}

MemoryWindow::~MemoryWindow() {
  if (!active_) return;
  for (auto it = opened_.rbegin(); it != opened_.rend(); ++it) vendor().closeAfterKernel(it->first, it->second);
  t_current = previous_;
}

void MemoryWindow::openBlock(const void* ptr) {
  const std::uint64_t token = vendor().openForKernel(ptr);
  if (token != 0) opened_.emplace_back(ptr, token);
}

MemoryWindow* MemoryWindow::current() { return memoryProtected() ? t_current : nullptr; }

}  // namespace ditorch
