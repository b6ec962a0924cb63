#pragma once
// The device memory one kernel works on, open to the host for the kernel's duration, for a vendor
// that protects device memory from the host (Vendor::protectsMemory; the emu vendor with
// DITORCH_EMU_PROTECT_MEMORY=1). The shim and the copies hold one per op: every block the op
// reads or writes is opened in it, blocks born inside it (the kernel's results and workspace)
// join it, and all are closed when it ends. On any other vendor it costs one branch.
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <utility>

namespace ditorch {

class MemoryWindow {
 public:
  MemoryWindow();
  ~MemoryWindow();
  MemoryWindow(const MemoryWindow&) = delete;
  MemoryWindow& operator=(const MemoryWindow&) = delete;

  // Opens the block holding `ptr` until this window ends (host memory and nullptr: nothing to do).
  void open(const void* ptr) {
    if (active_ && ptr != nullptr) openBlock(ptr);
  }
  void open(const c10::StorageImpl* storage) { open(storage->data()); }
  // This thread's innermost window, nullptr when none is open (or memory is not protected).
  static MemoryWindow* current();

 private:
  void openBlock(const void* ptr);

  bool active_;
  MemoryWindow* previous_ = nullptr;
  c10::SmallVector<std::pair<const void*, std::uint64_t>, 8> opened_;
};

}  // namespace ditorch
