#include "device/Guard.h"

#include "device/Event.h"
#include "device/Stream.h"
#include "device/vendor/Vendor.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace ditorch {
namespace {

thread_local int t_device = 0;

// A device index of -1 (a device without an index: "dipu", as torch.Stream(torch.device("dipu"))
// passes it) is the current device, as for CUDA's streams.
int indexOf(c10::DeviceIndex index) { return index < 0 ? currentDevice() : index; }

class DipuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (d.index() != old.index()) setCurrentDevice(d.index());
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kType, static_cast<c10::DeviceIndex>(currentDevice())); }
  void setDevice(c10::Device d) const override { setCurrentDevice(d.index()); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    t_device = d.index();
    if (const auto* runtime = vendor().streamRuntime()) runtime->uncheckedSetDevice(kernelDevice(d.index()));
  }
  c10::Stream getStream(c10::Device d) const override { return currentStream(indexOf(d.index())); }
  c10::Stream getDefaultStream(c10::Device d) const override { return defaultStream(indexOf(d.index())); }
  c10::Stream getNewStream(c10::Device d, int priority) const override { return newStream(indexOf(d.index()), priority); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    if (const auto* runtime = vendor().streamRuntime())
      return toDipuStream(runtime->getStreamFromGlobalPool(kernelDevice(indexOf(d.index())), high_priority));
    return newStream(indexOf(d.index()), 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override { return ditorch::exchangeStream(s); }
  c10::DeviceIndex deviceCount() const noexcept override { return static_cast<c10::DeviceIndex>(ditorch::deviceCount()); }

  // Events: the stream runtime's own where the vendor has one, else Event.h's (synchronous vendors).
  void destroyEvent(void* event, const c10::DeviceIndex device_index) const noexcept override {
    if (const auto* runtime = vendor().streamRuntime()) return runtime->destroyEvent(event, device_index);
    delete static_cast<Event*>(event);
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "event device index ", int(device_index),
                " does not match the stream's dipu:", int(stream.device_index()));
    if (const auto* runtime = vendor().streamRuntime())
      return runtime->record(event, toNativeStream(stream), device_index, flag);
    if (!*event) *event = new Event();
    recordEvent(*static_cast<Event*>(*event), stream, flag == c10::EventFlag::BACKEND_DEFAULT);
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (const auto* runtime = vendor().streamRuntime()) return runtime->block(event, toNativeStream(stream));
    if (event) blockStream(*static_cast<Event*>(event), stream);
  }
  bool queryEvent(void* event) const override {
    if (const auto* runtime = vendor().streamRuntime()) return runtime->queryEvent(event);
    return !event || ditorch::queryEvent(*static_cast<Event*>(event));
  }
  void synchronizeEvent(void* event) const override {
    if (const auto* runtime = vendor().streamRuntime()) return runtime->synchronizeEvent(event);
    if (event) ditorch::synchronizeEvent(*static_cast<Event*>(event));
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex device_index) const override {
    if (const auto* runtime = vendor().streamRuntime()) return runtime->elapsedTime(start, end, device_index);
    TORCH_CHECK(start && end, "elapsed_time: both events must be recorded before measuring");
    return elapsedMs(*static_cast<Event*>(start), *static_cast<Event*>(end));
  }
  bool queryStream(const c10::Stream& stream) const override {
    if (const auto* runtime = vendor().streamRuntime()) return runtime->queryStream(toNativeStream(stream));
    return true;
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    if (const auto* runtime = vendor().streamRuntime()) return runtime->synchronizeStream(toNativeStream(stream));
    vendor().synchronize(stream.device_index());
  }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    vendor().synchronize(indexOf(device_index));
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, DipuGuardImpl);

}  // namespace

int deviceCount() {
  static int n = vendor().deviceCount();
  return n;
}

int currentDevice() { return t_device; }

void checkDevice(int device) {
  TORCH_CHECK_INDEX(device >= 0 && device < deviceCount(), "dipu device index ", device,
                    " is out of range; this process has ", deviceCount(), " dipu device(s) (valid: 0..",
                    deviceCount() - 1, ")");
}

void setCurrentDevice(int device) {
  checkDevice(device);
  t_device = device;
  // The runtime's current device follows, so kernels and allocations without a tensor to place
  // them land on the dipu device's kernel device.
  if (const auto* runtime = vendor().streamRuntime()) runtime->setDevice(kernelDevice(device));
}

}  // namespace ditorch
