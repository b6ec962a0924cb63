#include "device/ChipProfile.h"

#include "device/vendor/Vendor.h"

#include <c10/util/Exception.h>

namespace ditorch {
namespace {
ChipProfile& active() {
  static ChipProfile profile;
  return profile;
}

void checkBits(const ChipProfile& p, const char* field, int bits) {
  TORCH_CHECK(bits >= 1 && bits <= 23, "chip profile '", p.name, "': ", field, " ", bits, " must be in [1, 23]");
}
}  // namespace

const ChipProfile& chipProfile() { return active(); }

void setChipProfile(const ChipProfile& profile) {
  TORCH_CHECK(profile.slowdown >= 0.0, "chip profile '", profile.name, "': time scale ", profile.slowdown,
              " must be >= 0 (0: speed not emulated)");
  TORCH_CHECK(profile.memory_bytes >= 0, "chip profile '", profile.name, "': memory must be >= 0");
  const Numerics& n = profile.numerics;
  checkBits(profile, "matmul_mantissa_bits", n.matmul_input_bits);
  checkBits(profile, "accumulator_bits", n.accumulator_bits);
  checkBits(profile, "special_function_bits", n.special_function_bits);
  TORCH_CHECK(n.accumulation_block >= 0, "chip profile '", profile.name, "': accumulation_block ",
              n.accumulation_block, " must be >= 0");
  active() = profile;
  // A vendor with a stream runtime runs kernels asynchronously at the device's own speed: the time a
  // kernel takes is not seen on the host, so there is nothing to emulate (memory and numerics apply).
  if (vendor().streamRuntime()) active().slowdown = 0.0;
}

}  // namespace ditorch
