#pragma once
// The vendor interface: what a chip's runtime must provide for ditorch to run PyTorch on it.
// In the spirit of DIPU's device APIs: raw memory, copies, streams/events, synchronisation and
// the native device type whose ATen kernels the operator shim re-dispatches to.
//
// Two vendors are built in: `emu` (EmuVendor.cpp: device memory is host memory, kernels are the
// CPU's, chips are emulated) and `native` (NativeVendor.cpp: any device type PyTorch itself runs,
// cuda on a GPU build, cpu everywhere, through PyTorch's device-generic interfaces).
#include <c10/core/DeviceType.h>
#include <c10/core/Allocator.h>
#include <c10/core/Stream.h>
#include <c10/core/TensorOptions.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace ditorch {

enum class CopyKind { HostToDevice, DeviceToHost, DeviceToDevice };

class Vendor {
 public:
  virtual ~Vendor() = default;
  virtual const char* name() const = 0;
  // ATen kernels of this backend run on the vendor's memory (zero-copy re-dispatch).
  virtual c10::DeviceType kernelDeviceType() const = 0;
  // Whether the host can dereference device pointers (then transports need no staging).
  virtual bool hostAddressable() const = 0;
  virtual int deviceCount() const = 0;

  // Raw device memory; nullptr when the device is out of memory.
  virtual void* malloc(std::size_t bytes, int device) = 0;
  virtual void free(void* ptr, int device) = 0;
  virtual void memcpy(void* dst, const void* src, std::size_t bytes, CopyKind kind, int device) = 0;
  virtual void synchronize(int device) = 0;

  // Whether malloc() already caches (a native runtime's caching allocator, which also knows which
  // stream last used a block): the dipu allocator then frees straight back instead of caching on
  // top, where a block freed on one stream could be handed to another while still in use.
  virtual bool cachesMemory() const { return false; }
  // Whether the vendor's kernels allocate through the host's allocator (emu: CPU kernels). The shim
  // then redirects those allocations into dipu blocks for the kernel's duration; otherwise a
  // kernel's results are the native allocator's memory and are adopted as dipu blocks as they are.
  virtual bool redirectsKernelAllocations() const { return false; }
  // The native runtime that owns streams and events (PyTorch's guard implementation of
  // kernelDeviceType()), or nullptr when kernels run synchronously on the calling thread: streams
  // are then names for work that is always done, and events timestamps.
  virtual const c10::impl::DeviceGuardImplInterface* streamRuntime() const { return nullptr; }

  // Memory the host may not touch outside the vendor's kernels. A vendor whose kernels run on the
  // host (emu) opens what a kernel touches for its duration; one whose kernels run on the device
  // needs no opening and keeps these no-ops. open returns a token that close must be given (a
  // block freed and remapped at the same address in between is then left alone).
  virtual bool protectsMemory() const { return false; }
  virtual std::uint64_t openForKernel(const void* /*ptr*/) { return 0; }
  virtual void closeAfterKernel(const void* /*ptr*/, std::uint64_t /*token*/) {}

  // A block of device memory used on `native_stream` (the runtime's stream) besides the one it was
  // allocated on: the vendor's caching allocator then keeps it until that stream's work is done.
  // `native_block` is the block as the vendor's allocator handed it out, or nullptr for one from
  // malloc() above. Only vendors with a stream runtime are asked.
  virtual void recordStream(void* /*ptr*/, const c10::DataPtr* /*native_block*/, c10::Stream /*native_stream*/) {}
  // (free, total) bytes of the vendor's device itself; (0, 0) when it has no limit of its own
  // (emu: the chip profile's capacity is all there is).
  virtual std::pair<std::size_t, std::size_t> memoryInfo(int /*device*/) const { return {0, 0}; }

  // Page-locked host memory for fast staging.
  virtual void* mallocHost(std::size_t bytes) = 0;
  virtual void freeHost(void* ptr) = 0;
};

// The process's vendor, chosen once (DITORCH_VENDOR, default "emu").
Vendor& vendor();

// The vendor's kernel device type and its dispatch key: where the shim re-dispatches.
// Computed once (the vendor is chosen once); asked several times per op.
inline c10::DeviceType kernelDeviceType() {
  static const c10::DeviceType type = vendor().kernelDeviceType();
  return type;
}
inline c10::DispatchKey kernelDispatchKey() {
  static const c10::DispatchKey key =
      c10::computeDispatchKey(std::nullopt, std::nullopt, c10::Device(kernelDeviceType()));
  return key;
}
// Whether kernels allocate through the host's allocator, redirected into dipu blocks (emu), rather
// than from their device's own allocator (native). Asked per op: computed once.
inline bool kernelAllocationsRedirected() {
  static const bool redirected = vendor().redirectsKernelAllocations();
  return redirected;
}
// The kernel device behind dipu:`index`. A CPU kernel device has no index (CPU tensors carry none).
inline c10::Device kernelDevice(int index) {
  if (kernelDeviceType() == c10::DeviceType::CPU) return c10::Device(c10::DeviceType::CPU);
  return c10::Device(kernelDeviceType(), static_cast<c10::DeviceIndex>(index));
}
// Name -> vendor: "emu", or a device type PyTorch runs here ("cuda", "cpu", ...) for the native
// vendor over it. Throws naming what is known when `name` is neither.
Vendor& selectVendor(const std::string& name);
// The built-in vendors (EmuVendor.cpp, NativeVendor.cpp). nativeVendor throws when PyTorch
// cannot run `type` here.
Vendor& emuVendor();
Vendor& nativeVendor(c10::DeviceType type);

// Page-locked host memory from the host's allocator: what a vendor without a pinned allocator of
// its own hands out (the page lock is best effort: without the privilege the buffer still works).
void* pageLockedAlloc(std::size_t bytes);
void pageLockedFree(void* ptr);

}  // namespace ditorch
