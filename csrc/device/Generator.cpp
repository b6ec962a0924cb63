#include "device/Generator.h"

#include "device/Guard.h"
#include "device/vendor/Vendor.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <mutex>
#include <vector>

namespace ditorch {
namespace {
// A generator of the vendor's kernel device, of its own (not the device's default: dipu random
// numbers stay independent of the kernel device's, as the CPU's are of CUDA's).
at::Generator newKernelGenerator(int device, uint64_t seed) {
  if (kernelDeviceType() == c10::DeviceType::CPU) return at::detail::createCPUGenerator(seed);
  at::Generator g = at::globalContext().getAcceleratorHooksInterface(kernelDeviceType()).getNewGenerator(
      static_cast<c10::DeviceIndex>(device));
  g.set_current_seed(seed);
  return g;
}
}  // namespace

DipuGenerator::DipuGenerator(int device, uint64_t seed)
    : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)),
                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      inner_(newKernelGenerator(device, seed)) {}

void DipuGenerator::set_current_seed(uint64_t seed) { inner_.set_current_seed(seed); }
void DipuGenerator::set_offset(uint64_t offset) { inner_.set_offset(offset); }
uint64_t DipuGenerator::get_offset() const { return inner_.get_offset(); }
uint64_t DipuGenerator::current_seed() const { return inner_.current_seed(); }
uint64_t DipuGenerator::seed() { return inner_.seed(); }
void DipuGenerator::set_state(const c10::TensorImpl& state) { inner_.unsafeGetGeneratorImpl()->set_state(state); }
c10::intrusive_ptr<c10::TensorImpl> DipuGenerator::get_state() const { return inner_.unsafeGetGeneratorImpl()->get_state(); }

DipuGenerator* DipuGenerator::clone_impl() const {
  auto* copy = new DipuGenerator(device().index());
  copy->inner_ = inner_.clone();
  return copy;
}

const at::Generator& defaultGenerator(int device) {
  static std::vector<at::Generator> generators = [] {
    std::vector<at::Generator> g;
    for (int d = 0; d < deviceCount(); ++d) g.push_back(at::make_generator<DipuGenerator>(d));
    return g;
  }();
  checkDevice(device < 0 ? currentDevice() : device);
  return generators[device < 0 ? currentDevice() : device];
}

at::Generator newGenerator(int device) {
  int d = device < 0 ? currentDevice() : device;
  checkDevice(d);
  return at::make_generator<DipuGenerator>(d);
}

}  // namespace ditorch
