#pragma once
// Device memory: a caching allocator over the vendor's malloc, with the chip profile's capacity
// enforced (torch.OutOfMemoryError past it). It is a c10::DeviceAllocator, so PyTorch's generic
// memory API (torch.accelerator.memory_allocated(), memory_stats(), empty_cache(), ...) reads
// its statistics, kept in CUDA's own structure (c10::CachingDeviceAllocator::DeviceStats).
//
// What the statistics count (docs/device.md, "Device memory"):
//   - a block of ours is rounded up to 512 bytes (requests up to 1 MiB: the small pool) or to
//     128 KiB (larger: the large pool); allocated_bytes and reserved_bytes count rounded sizes,
//     requested_bytes the sizes asked for;
//   - a kernel result adopted from a native vendor's own allocator counts its nbytes as they are
//     (the native allocator rounds in its own way) as one allocation and one segment.
#include "device/TorchCompat.h"

#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <utility>

namespace ditorch {

using DeviceStats = c10::CachingDeviceAllocator::DeviceStats;

class DeviceAllocator final : public c10::DeviceAllocator {
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

  // c10::DeviceAllocator: what torch.accelerator's memory API calls.
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
  // A block used on another stream than the one it was allocated on: on a vendor with a stream
  // runtime (its caching allocator frees by stream), the vendor's allocator records the use;
  // on a synchronous vendor every stream's work is done when the host frees, so nothing to do.
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override;
  DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  // (free, total) bytes of the chip: its profile's capacity less what ditorch reserved, and no
  // more than the vendor's device has free where it says (a native vendor).
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override;

  // Whether `p` is a whole block this allocator handed out (its deleter is ours):
  // no lock, no lookup, so the shim can ask it of every kernel result.
  static bool isBlock(const c10::DataPtr& p);
  // The dipu device of a pointer at the start of a block of ours; -1 when it is not one. A kernel
  // result adopted from a native vendor is the vendor's memory: its device is the vendor's to say
  // (Vendor::deviceOfPointer).
  int deviceOf(const void* ptr) const;
  bool owns(const void* ptr) const { return deviceOf(ptr) >= 0; }
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
