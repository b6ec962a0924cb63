#pragma once
// The vendor interface: what a chip's runtime must provide for ditorch to run PyTorch on it.
// In the spirit of DIPU's device APIs: raw memory, copies, streams/events, synchronisation and
// the native device type whose ATen kernels the operator shim re-dispatches to.
#include <c10/core/DeviceType.h>
#include <c10/core/TensorOptions.h>

#include <cstddef>
#include <cstdint>
#include <string>

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

  // Memory the host may not touch outside the vendor's kernels. A vendor whose kernels run on the
  // host (emu) opens what a kernel touches for its duration; one whose kernels run on the device
  // needs no opening and keeps these no-ops. open returns a token that close must be given (a
  // block freed and remapped at the same address in between is then left alone).
  virtual bool protectsMemory() const { return false; }
  virtual std::uint64_t openForKernel(const void* /*ptr*/) { return 0; }
  virtual void closeAfterKernel(const void* /*ptr*/, std::uint64_t /*token*/) {}

  // Page-locked host memory for fast staging.
  virtual void* mallocHost(std::size_t bytes) = 0;
  virtual void freeHost(void* ptr) = 0;
};

// The process's vendor, chosen once (DITORCH_VENDOR, default "emu").
Vendor& vendor();

// The vendor's kernel device (CPU for emu) and its dispatch key: where the shim re-dispatches.
// Computed once (the vendor is chosen once); asked several times per op.
inline c10::Device kernelDevice() {
  static const c10::Device device(vendor().kernelDeviceType());
  return device;
}
inline c10::DispatchKey kernelDispatchKey() {
  static const c10::DispatchKey key = c10::computeDispatchKey(std::nullopt, std::nullopt, kernelDevice());
  return key;
}
// Name -> vendor; throws with the known names when `name` is not built in.
Vendor& selectVendor(const std::string& name);

}  // namespace ditorch
