#pragma once
// dipu random generators. The vendor's random kernels accept only generators of their own device
// (the CPU's for emu), so a dipu generator owns one of the kernel device that holds its state; the
// shim hands that inner generator to the kernels. `torch.manual_seed` seeds it like any device's.
#include <ATen/core/Generator.h>

namespace ditorch {

class DipuGenerator final : public c10::GeneratorImpl {
 public:
  explicit DipuGenerator(int device, uint64_t seed = 67280421310721ULL);
  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }
  // The generator the vendor's kernels consume.
  const at::Generator& kernelGenerator() const { return inner_; }

 private:
  DipuGenerator* clone_impl() const override;
  at::Generator inner_;
};

const at::Generator& defaultGenerator(int device);
at::Generator newGenerator(int device);

}  // namespace ditorch
