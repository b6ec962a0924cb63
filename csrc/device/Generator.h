#pragma once
// dipu random generators.
//
// Where the vendor's kernel device is the CPU (emu, the cpu vendor), dipu keeps its random numbers
// as accelerators do: a counter-based generator whose whole state is (seed, offset), 16 bytes
// laid out as CUDA's Philox state (seed then offset, each a little-endian uint64), which is what
// DTensor's RNG tracker reads and writes through torch.dipu.get_rng_state/set_rng_state. A random
// op that draws n values takes the counters offset .. offset+n-1 (element i, in row-major order,
// the counter offset+i: CounterRandom.h) and advances the offset by n rounded up to a multiple of 4,
// as CUDA's Philox offsets advance. Ops ditorch does not draw itself (randperm, multinomial,
// poisson, ...) run the kernel device's generator seeded from (seed, offset) and advance the offset
// by 4: reproducible from the state, though not indexed by element.
//
// On another kernel device (DITORCH_VENDOR=cuda, ...) the vendor's own generator serves: its
// state, its streams.
#include <ATen/core/Generator.h>

#include <cstdint>

namespace ditorch {

class DipuGenerator final : public c10::GeneratorImpl {
 public:
  static constexpr uint64_t kDefaultSeed = 67280421310721ULL;
  static constexpr int64_t kStateBytes = 16;  // (seed, offset) of a counter-based generator

  explicit DipuGenerator(int device, uint64_t seed = kDefaultSeed);
  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

  // Whether dipu's own counter-based stream serves (else the vendor's generator).
  bool counterBased() const { return counter_based_; }
  // Takes `count` counters for one op (the caller holds mutex_): the first; the offset moves past
  // them, rounded up to a multiple of 4.
  uint64_t takeCounters(uint64_t count);
  // The generator the vendor's kernels consume. A counter-based generator hands the kernel
  // device's generator seeded from (seed, offset) and takes 4 counters for it.
  at::Generator kernelGenerator();

 private:
  DipuGenerator* clone_impl() const override;
  at::Generator inner_;
  bool counter_based_;
  uint64_t seed_ = kDefaultSeed;
  uint64_t offset_ = 0;
};

const at::Generator& defaultGenerator(int device);
at::Generator newGenerator(int device);

}  // namespace ditorch
