#pragma once
// Device memory: a caching allocator over the vendor's malloc with CUDA-style statistics and
// the chip profile's capacity enforced (torch.OutOfMemoryError past it).
#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <vector>

namespace ditorch {

struct MemoryStats {
  int64_t allocated = 0, peak_allocated = 0;  // bytes in live blocks
  int64_t reserved = 0, peak_reserved = 0;    // bytes held from the vendor (live + cached)
  int64_t num_allocs = 0, num_frees = 0, num_ooms = 0, num_cache_hits = 0;
};

class DeviceAllocator final : public c10::Allocator {
 public:
  // Allocates on the current device.
  c10::DataPtr allocate(size_t bytes) override;
  // `tag` is the device stamped on the DataPtr: dipu for device tensors, CPU while a shim
  // kernel allocates through the host allocator (its memory is still device memory).
  c10::DataPtr allocateOn(size_t bytes, int device, c10::Device tag);
  // A fresh block of `bytes` on `device` holding a copy of `src`'s first `copy_bytes` bytes: the
  // one allocate-and-copy behind storage resizes and kernel results born outside our blocks.
  c10::DataPtr copyToNewBlock(const void* src, size_t copy_bytes, size_t bytes, int device, c10::Device tag);
  // A kernel's result in the vendor's own memory as a dipu block on `device`, no copy (vendors
  // whose kernels allocate natively): `owned` when the kernel storage gave its block up, else
  // `shared`, the kernel storage still holding it. Counted against the chip's capacity.
  c10::DataPtr adopt(c10::DataPtr owned, c10::Storage shared, size_t bytes, int device);
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dst, const void* src, std::size_t bytes) const override;

  bool owns(const void* ptr) const;
  // Whether `p` is a whole block this allocator handed out (its deleter is ours): no lock, no
  // lookup, so the shim can ask it of every kernel result.
  static bool isBlock(const c10::DataPtr& p);
  int deviceOf(const void* ptr) const;  // -1 when not ours
  MemoryStats stats(int device) const;
  void resetPeakStats(int device);
  void emptyCache();  // returns every cached block to the vendor
};

DeviceAllocator& deviceAllocator();

// Resizes a dipu storage like CPU storages resize: a new block, the common prefix copied, swapped in.
void resizeDeviceStorage(c10::StorageImpl* storage, size_t nbytes);

// While alive, CPU allocations on this thread come from device `device` (the shim wraps the
// CPU kernels it runs in it, so their outputs are born in device memory: no copy afterwards).
// Only for a vendor that redirects kernel allocations (emu); a no-op for the others.
class KernelAllocationScope {
 public:
  explicit KernelAllocationScope(int device);
  ~KernelAllocationScope();
  KernelAllocationScope(const KernelAllocationScope&) = delete;
  KernelAllocationScope& operator=(const KernelAllocationScope&) = delete;

 private:
  int previous_;
};

// Installs the redirecting CPU allocator (once, at extension load, for a vendor that redirects).
void installKernelHostAllocator();

}  // namespace ditorch
