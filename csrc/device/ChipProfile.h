#pragma once
// The emulated chip this process behaves as. Profiles are parsed and validated in Python
// (ditorch_ext/profiles.py) and handed over once; the runtime only reads them.
#include <cstdint>
#include <string>

namespace ditorch {

struct ChipProfile {
  std::string name = "host";
  int64_t memory_bytes = 0;      // per device; 0 = unlimited
  double slowdown = 1.0;         // wall-time factor applied to every kernel (>= 1)
  int matmul_mantissa_bits = 23; // fp32 matmul inputs rounded to this many mantissa bits
  bool flush_denormals = false;  // float outputs below the normal range become zero
};

const ChipProfile& chipProfile();
void setChipProfile(const ChipProfile& profile);

}  // namespace ditorch
