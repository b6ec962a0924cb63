// The native vendor: dipu over a device type PyTorch itself runs (cuda on a GPU build of torch,
// xpu, mps, ... and cpu everywhere). Everything comes from PyTorch's device-generic interfaces,
// which the device's own build of torch fills in at run time, so this file needs no vendor
// toolkit to compile:
//   - device memory: the type's registered allocator (c10::GetAllocator; CUDA's caching allocator);
//   - streams, events, device count, synchronisation: its DeviceGuardImplInterface;
//   - pinned host memory: its host allocator (at::getHostAllocator);
//   - free and total memory: its torch module (torch.cuda.mem_get_info; ditorch_ext/device_module.py);
//   - copies: ATen's copy_ between tensors over the raw pointers;
//   - kernels: the type's ATen kernels, which the shim re-dispatches to on the same storage.
// Device memory is never host-addressable here, even for cpu: everything host-side (DiComm's
// staging, .item(), printing) then takes the path a GPU needs, and `DITORCH_VENDOR=cpu` tests it
// on every machine.
#include "device/vendor/Vendor.h"

#include <ATen/Context.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <map>
#include <memory>
#include <mutex>

#include <unistd.h>

namespace ditorch {
namespace {

class NativeVendor final : public Vendor {
 public:
  explicit NativeVendor(c10::DeviceType type) : type_(type), name_(c10::DeviceTypeName(type, /*lower_case=*/true)) {
    if (type_ != c10::DeviceType::CPU) {
      TORCH_CHECK(c10::impl::hasDeviceGuardImpl(type_), "DITORCH_VENDOR=", name_, ": this build of PyTorch has no ",
                  name_, " runtime (it runs cpu", at::hasCUDA() ? ", cuda" : "", "); use DITORCH_VENDOR=emu or cpu");
      runtime_ = c10::impl::getDeviceGuardImpl(type_);
      TORCH_CHECK(runtime_->deviceCount() > 0, "DITORCH_VENDOR=", name_, ": no ", name_, " device is visible");
      // The runtime's allocators and generators are set up on first use of the device.
      at::globalContext().lazyInitDevice(type_);
      try {
        host_ = at::getHostAllocator(type_);
      } catch (const c10::Error&) {
        host_ = nullptr;  // no pinned allocator for this type: page-locked host memory instead
      }
    }
    allocator_ = c10::GetAllocator(type_);
    TORCH_CHECK(allocator_ != nullptr, "DITORCH_VENDOR=", name_, ": PyTorch registers no allocator for ", name_);
  }

  const char* name() const override { return name_.c_str(); }
  c10::DeviceType kernelDeviceType() const override { return type_; }
  bool hostAddressable() const override { return false; }
  int deviceCount() const override { return runtime_ ? runtime_->deviceCount() : 1; }

  void* malloc(std::size_t bytes, int device) override {
    OnDevice on(runtime_, type_, device);
    try {
      return allocator_->raw_allocate(bytes);
    } catch (const c10::OutOfMemoryError&) {
      return nullptr;  // the dipu allocator reports it, naming the dipu device
    }
  }
  void free(void* ptr, int device) override {
    OnDevice on(runtime_, type_, device);
    allocator_->raw_deallocate(ptr);
  }
  void memcpy(void* dst, const void* src, std::size_t bytes, CopyKind kind, int device) override {
    if (!bytes) return;
    OnDevice on(runtime_, type_, device);
    bytesAt(dst, bytes, kind != CopyKind::DeviceToHost, device)
        .copy_(bytesAt(const_cast<void*>(src), bytes, kind != CopyKind::HostToDevice, device));
  }
  void synchronize(int device) override {
    if (runtime_) runtime_->synchronizeDevice(static_cast<c10::DeviceIndex>(device));
  }
  bool cachesMemory() const override { return true; }
  const c10::impl::DeviceGuardImplInterface* streamRuntime() const override { return runtime_; }

  void recordStream(void* ptr, const c10::DataPtr* native_block, c10::Stream native_stream) override {
    auto* device_allocator = dynamic_cast<c10::DeviceAllocator*>(allocator_);
    if (!device_allocator) return;  // an allocator without stream-ordered reuse needs no record
    if (native_block) return device_allocator->recordStream(*native_block, native_stream);
    // A block from malloc() (raw_allocate): as its allocator's raw deleter would free it.
    c10::DataPtr block(ptr, ptr, allocator_->raw_deleter(), native_stream.device());
    device_allocator->recordStream(block, native_stream);
    block.release_context();  // only described, not owned: never freed from here
  }
  std::pair<std::size_t, std::size_t> memoryInfo(int device) const override {
    if (type_ == c10::DeviceType::CPU) {
      const auto page = static_cast<std::size_t>(sysconf(_SC_PAGE_SIZE));
      return {page * static_cast<std::size_t>(sysconf(_SC_AVPHYS_PAGES)), page * static_cast<std::size_t>(sysconf(_SC_PHYS_PAGES))};
    }
    auto* device_allocator = dynamic_cast<c10::DeviceAllocator*>(allocator_);
    if (!device_allocator) return {0, 0};
    try {
      return device_allocator->getMemoryInfo(static_cast<c10::DeviceIndex>(device));
    } catch (const c10::Error&) {
      return {0, 0};  // the runtime does not say (getMemoryInfo not implemented for it)
    }
  }

  void* mallocHost(std::size_t bytes) override {
    if (!host_) return pageLockedAlloc(bytes);
    c10::DataPtr block = host_->allocate(bytes);
    void* ptr = block.get();
    std::lock_guard<std::mutex> lock(mu_);
    host_blocks_.emplace(ptr, std::move(block));
    return ptr;
  }
  void freeHost(void* ptr) override {
    if (!host_) return pageLockedFree(ptr);
    c10::DataPtr block;  // freed outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    auto it = host_blocks_.find(ptr);
    TORCH_INTERNAL_ASSERT(it != host_blocks_.end(), "freeing pinned memory the ", name_, " vendor did not allocate");
    block = std::move(it->second);
    host_blocks_.erase(it);
  }

 private:
  // The runtime's current device is `device` while alive (allocations and copies land there).
  class OnDevice {
   public:
    OnDevice(const c10::impl::DeviceGuardImplInterface* runtime, c10::DeviceType type, int device) : runtime_(runtime) {
      if (runtime_) previous_ = runtime_->exchangeDevice(c10::Device(type, static_cast<c10::DeviceIndex>(device)));
    }
    ~OnDevice() {
      if (runtime_) runtime_->uncheckedSetDevice(previous_);
    }

   private:
    const c10::impl::DeviceGuardImplInterface* runtime_;
    c10::Device previous_{c10::DeviceType::CPU};
  };

  // `bytes` bytes at `ptr` as a tensor of the device (or the host), for ATen's copy_ to move.
  at::Tensor bytesAt(void* ptr, std::size_t bytes, bool on_device, int device) const {
    const c10::Device where = on_device && type_ != c10::DeviceType::CPU
                                  ? c10::Device(type_, static_cast<c10::DeviceIndex>(device))
                                  : c10::Device(c10::DeviceType::CPU);
    return at::from_blob(ptr, {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(where));
  }

  c10::DeviceType type_;
  std::string name_;
  const c10::impl::DeviceGuardImplInterface* runtime_ = nullptr;  // nullptr for cpu: synchronous
  c10::Allocator* allocator_ = nullptr;
  at::HostAllocator* host_ = nullptr;
  std::mutex mu_;
  std::map<void*, c10::DataPtr> host_blocks_;
};

}  // namespace

Vendor& nativeVendor(c10::DeviceType type) {
  static std::mutex mu;
  static std::map<c10::DeviceType, std::unique_ptr<NativeVendor>> vendors;
  std::lock_guard<std::mutex> lock(mu);
  auto& v = vendors[type];
  if (!v) v = std::make_unique<NativeVendor>(type);
  return *v;
}

}  // namespace ditorch
