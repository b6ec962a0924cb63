#include "device/Event.h"

#include "device/vendor/Vendor.h"

#include <c10/util/Exception.h>

#include <chrono>

namespace ditorch {
namespace {
double nowMs() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void recordEvent(Event& event, const c10::Stream& stream, bool enable_timing) {
  TORCH_CHECK(event.device < 0 || event.device == stream.device_index(), "event was created on dipu:", event.device,
              " but recorded on a stream of dipu:", static_cast<int>(stream.device_index()));
  event.device = stream.device_index();
  // The stream's prior work is complete once the vendor synchronises, so the timestamp marks
  // exactly the point the event stands for.
  vendor().synchronize(event.device);
  event.recorded = true;
  event.timing = enable_timing;
  event.recorded_at_ms = nowMs();
}

void blockStream(const Event& event, const c10::Stream&) {
  // Work recorded before the event has finished by construction on a synchronous vendor.
  if (event.recorded) vendor().synchronize(event.device);
}

bool queryEvent(const Event&) { return true; }

void synchronizeEvent(const Event& event) {
  if (event.recorded) vendor().synchronize(event.device);
}

double elapsedMs(const Event& start, const Event& end) {
  TORCH_CHECK(start.recorded && end.recorded, "elapsed_time: both events must be recorded before measuring");
  TORCH_CHECK(start.timing && end.timing, "elapsed_time: both events must be created with enable_timing=True");
  TORCH_CHECK(start.device == end.device, "elapsed_time: events are on different devices (dipu:", start.device,
              " and dipu:", end.device, ")");
  return end.recorded_at_ms - start.recorded_at_ms;
}

}  // namespace ditorch
