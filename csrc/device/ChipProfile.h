#pragma once
// The emulated chip this process behaves as. Profiles are parsed and validated in Python
// (ditorch_ext/profiles.py) and handed over once; the runtime only reads them.
#include <cstdint>
#include <string>

namespace ditorch {

// How the chip's arithmetic differs from the host's IEEE arithmetic (the defaults: none).
struct Numerics {
  int matmul_input_bits = 23;      // fp32 matmul inputs rounded to this many mantissa bits (TF32: 10)
  int accumulator_bits = 23;       // mantissa bits the matmul accumulator keeps between K-blocks
  int accumulation_block = 0;      // K-terms summed in fp32 before each accumulator rounding (0: all of K)
  bool round_toward_zero = false;  // matmul, cast and special-function results narrowed to bf16/fp16 are truncated
  int special_function_bits = 23;  // mantissa bits of exp, softmax, rsqrt, silu, ... results
  bool flush_denormals = false;    // float results below the normal range become zero

  // Whether the matmul family's results differ from the host's (beyond the input rounding).
  bool emulatesAccumulation() const { return accumulator_bits < 23 || accumulation_block > 0 || round_toward_zero; }
  bool emulatesSpecialFunctions() const { return special_function_bits < 23 || round_toward_zero; }
  bool any() const {
    return matmul_input_bits < 23 || emulatesAccumulation() || emulatesSpecialFunctions() || flush_denormals;
  }
};

struct ChipProfile {
  std::string name = "host";
  int64_t memory_bytes = 0;  // per device; 0 = unlimited
  // The job's time scale: how many times slower than its datasheet (KernelCosts.h) the chip
  // runs; 0: its speed is not emulated (the host profile, a vendor with its own stream runtime).
  double slowdown = 0.0;
  Numerics numerics;
};

const ChipProfile& chipProfile();
void setChipProfile(const ChipProfile& profile);

}  // namespace ditorch
