#include "device/ChipProfile.h"

#include <c10/util/Exception.h>

namespace ditorch {
namespace {
ChipProfile& active() {
  static ChipProfile profile;
  return profile;
}
}  // namespace

const ChipProfile& chipProfile() { return active(); }

void setChipProfile(const ChipProfile& profile) {
  TORCH_CHECK(profile.slowdown >= 1.0, "chip profile '", profile.name, "': slowdown ", profile.slowdown, " must be >= 1");
  TORCH_CHECK(profile.matmul_mantissa_bits >= 1 && profile.matmul_mantissa_bits <= 23, "chip profile '", profile.name,
              "': matmul_mantissa_bits ", profile.matmul_mantissa_bits, " must be in [1, 23]");
  TORCH_CHECK(profile.memory_bytes >= 0, "chip profile '", profile.name, "': memory must be >= 0");
  active() = profile;
}

}  // namespace ditorch
