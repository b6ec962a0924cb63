#include "device/Generator.h"

#include "device/CounterRandom.h"
#include "device/Guard.h"
#include "device/vendor/Vendor.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <c10/core/TensorImpl.h>

#include <cstring>
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
      inner_(newKernelGenerator(device, seed)),
      counter_based_(kernelDeviceType() == c10::DeviceType::CPU),
      seed_(seed) {}

void DipuGenerator::set_current_seed(uint64_t seed) {
  if (!counter_based_) return inner_.set_current_seed(seed);
  seed_ = seed;
  offset_ = 0;
}

void DipuGenerator::set_offset(uint64_t offset) {
  if (!counter_based_) return inner_.set_offset(offset);
  offset_ = offset;
}

uint64_t DipuGenerator::get_offset() const { return counter_based_ ? offset_ : inner_.get_offset(); }
uint64_t DipuGenerator::current_seed() const { return counter_based_ ? seed_ : inner_.current_seed(); }

uint64_t DipuGenerator::seed() {
  if (!counter_based_) return inner_.seed();
  set_current_seed(c10::detail::getNonDeterministicRandom());
  return seed_;
}

void DipuGenerator::set_state(const c10::TensorImpl& state) {
  if (!counter_based_) return inner_.unsafeGetGeneratorImpl()->set_state(state);
  TORCH_CHECK(state.dtype() == caffe2::TypeMeta::Make<uint8_t>(), "dipu generator state: expected a torch.uint8 "
              "tensor, got ", state.dtype().name());
  TORCH_CHECK(state.numel() == kStateBytes, "dipu generator state: expected ", kStateBytes,
              " bytes (seed and offset, two uint64), got ", state.numel(), " bytes");
  TORCH_CHECK(state.device().is_cpu() && state.is_contiguous(), "dipu generator state: expected a contiguous CPU "
              "tensor, got one on ", state.device());
  const auto* bytes = static_cast<const uint8_t*>(state.data());
  std::memcpy(&seed_, bytes, sizeof(seed_));
  std::memcpy(&offset_, bytes + sizeof(seed_), sizeof(offset_));
}

c10::intrusive_ptr<c10::TensorImpl> DipuGenerator::get_state() const {
  if (!counter_based_) return inner_.unsafeGetGeneratorImpl()->get_state();
  at::Tensor state = at::empty({kStateBytes}, at::TensorOptions().dtype(at::kByte));
  auto* bytes = state.data_ptr<uint8_t>();
  std::memcpy(bytes, &seed_, sizeof(seed_));
  std::memcpy(bytes + sizeof(seed_), &offset_, sizeof(offset_));
  return state.getIntrusivePtr();
}

uint64_t DipuGenerator::takeCounters(uint64_t count) {
  const uint64_t first = offset_;
  offset_ += (count + 3) / 4 * 4;
  return first;
}

at::Generator DipuGenerator::kernelGenerator() {
  if (!counter_based_) return inner_;
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t counter = takeCounters(4);
  // One Philox block of (seed, counter) seeds the kernel device's generator: another state,
  // other numbers; the same state, the same numbers.
  const PhiloxBlock block = philox(seed_, counter);
  inner_.set_current_seed(uint64_t(block.w[0]) << 32 | block.w[1]);
  return inner_;
}

DipuGenerator* DipuGenerator::clone_impl() const {
  auto* copy = new DipuGenerator(device().index());
  copy->inner_ = inner_.clone();
  copy->seed_ = seed_;
  copy->offset_ = offset_;
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
