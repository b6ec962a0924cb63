// How many accepted connections a listener greets at once (StreamTransport). The group's bound is
// twice what the whole group could dial at once, and 64 more. Out of descriptors (EMFILE), the
// bound drops to half the greetings held (the oldest go, and the descriptors they free are there
// for the next connection and for the pairs being set up); it returns to the group's bound once
// the process has room for that many descriptors again, so a flood that ended does not keep the
// listener evicting the real peers of a group that dials all at once.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dicomm {

class GreetingBound {
 public:
  // The bound in force, for a group whose own bound is `groupBound`.
  size_t limit(size_t groupBound) const { return cap_ < groupBound ? cap_ : groupBound; }
  bool lowered() const { return cap_ != SIZE_MAX; }
  // Out of descriptors with `held` greetings open.
  void exhausted(size_t held);
  // A connection was accepted with `freeDescriptors` left: with room for the whole group's bound
  // the bound is the group's again; with less, it rises to half of the room (never falls here).
  void accepted(size_t groupBound, size_t freeDescriptors);

  static constexpr size_t kFloor = 4;

 private:
  size_t cap_ = SIZE_MAX;
};

// Descriptors this process may still open (RLIMIT_NOFILE less those open); SIZE_MAX when unknown.
// Reads /proc/self/fd: called only while a bound is lowered.
size_t freeDescriptors();

}  // namespace dicomm
