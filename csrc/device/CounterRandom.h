#pragma once
// dipu's counter-based random numbers: what a random op draws from a counter-based DipuGenerator
// (Generator.h). Element i (row-major) of an op that starts at counter c takes the Philox4x32-10
// block of key = seed, counter = c + i (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC'11), so its value is a function of (seed, offset + i) alone: a shard of a DTensor whose
// elements are the run offset+k .. of the full tensor's gets the values the full tensor has
// there, on any number of ranks. docs/device.md ("Random numbers") gives each distribution's
// transform.
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>

namespace ditorch {

struct PhiloxBlock {
  uint32_t w[4];
};

// Philox4x32-10 of the 64-bit key `seed` and the 128-bit counter (counter, 0).
PhiloxBlock philox(uint64_t seed, uint64_t counter);

// Whether ditorch draws `op` itself from a counter-based generator (uniform_, normal_, random_,
// bernoulli, exponential_, geometric_, log_normal_, cauchy_, native_dropout).
bool drawsCounterBased(const c10::OperatorHandle& op);

// Runs such an op. `stack` holds its arguments with the dipu tensors already re-viewed as kernel
// (CPU) tensors and its generator argument left as the caller gave it (a dipu generator or None:
// then dipu:`device`'s default one); leaves its results.
void drawCounterBased(const c10::OperatorHandle& op, torch::jit::Stack* stack, int device);

}  // namespace ditorch
