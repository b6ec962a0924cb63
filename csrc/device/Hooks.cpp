// PrivateUse1 hooks: how ATen asks the dipu runtime for generators, pinned memory, devices.
#include "device/Allocator.h"
#include "device/Generator.h"
#include "device/Guard.h"
#include "device/HostAllocator.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/StorageImpl.h>

namespace ditorch {
namespace {

struct DipuHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return deviceCount() > 0; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    return defaultGenerator(device_index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override { return newGenerator(device_index); }
  at::Device getDeviceFromPtr(void* data) const override {
    int d = deviceAllocator().deviceOf(data);
    TORCH_CHECK(d >= 0, "pointer ", data, " was not allocated by the dipu allocator");
    return at::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(d));
  }
  bool isPinnedPtr(const void* data) const override { return pinnedHostAllocator().isPinned(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &pinnedHostAllocator(); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(ditorch::deviceCount()); }
  void setCurrentDevice(c10::DeviceIndex device) const override { ditorch::setCurrentDevice(device); }
  c10::DeviceIndex getCurrentDevice() const override { return static_cast<c10::DeviceIndex>(currentDevice()); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto old = getCurrentDevice();
    ditorch::setCurrentDevice(device);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override { return exchangeDevice(device); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resizeDeviceStorage(storage.unsafeGetStorageImpl(), newsize);
  }
};

}  // namespace

void registerHooks() {
  static DipuHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
}

}  // namespace ditorch
