// Message tags: which op and which piece of it a message belongs to.
//
//   bits 63..60  kind (1 = user point-to-point, 2 = collective, 3 = control)
//   p2p:         bits 31..0  the user's tag
//   collective:  bits 59..28 the group's collective sequence number (mod 2^32)
//                bits 27..26 phase, 25..16 ring step, 15..0 chunk
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace dicomm {

inline uint64_t p2pTag(int64_t userTag) {
  return (uint64_t(1) << 60) | (static_cast<uint64_t>(userTag) & 0xffffffffULL);
}

// A ring over n ranks takes steps 0 .. n-2, and the step field has 10 bits: larger groups are
// refused when they are made, never in the middle of a collective.
constexpr int kMaxGroupSize = 1025;

inline uint64_t collectiveTag(uint64_t seq, unsigned phase, unsigned step, unsigned chunk) {
  if (phase > 3 || step > 1023 || chunk > 65535) {
    throw std::invalid_argument("dicomm: collective tag out of range (phase " +
                                std::to_string(phase) + ", step " + std::to_string(step) +
                                ", chunk " + std::to_string(chunk) + ")");
  }
  return (uint64_t(2) << 60) | ((seq & 0xffffffffULL) << 28) | (uint64_t(phase) << 26) |
         (uint64_t(step) << 16) | chunk;
}

// Control message: "this rank aborted, here is why" (payload: the cause as text).
inline uint64_t abortNoticeTag() { return uint64_t(3) << 60; }
inline bool isControlTag(uint64_t tag) { return (tag >> 60) == 3; }

inline std::string describeTag(uint64_t tag) {
  if ((tag >> 60) == 1) return "p2p tag " + std::to_string(static_cast<int32_t>(tag & 0xffffffff));
  return "collective #" + std::to_string((tag >> 28) & 0xffffffff) + " phase " +
         std::to_string((tag >> 26) & 3) + " step " + std::to_string((tag >> 16) & 1023) +
         " chunk " + std::to_string(tag & 0xffff);
}

}  // namespace dicomm
