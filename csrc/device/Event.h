#pragma once
// Events: record marks the point in a stream's work, block makes a stream wait for it, query and
// synchronize observe it, and elapsed time is measured between two recorded events.
#include <c10/core/Stream.h>

namespace ditorch {

struct Event {
  int device = -1;
  bool recorded = false;
  bool timing = false;
  double recorded_at_ms = 0.0;  // host clock after the stream's prior work completed
};

void recordEvent(Event& event, const c10::Stream& stream, bool enable_timing);
void blockStream(const Event& event, const c10::Stream& stream);
bool queryEvent(const Event& event);
void synchronizeEvent(const Event& event);
double elapsedMs(const Event& start, const Event& end);

}  // namespace ditorch
