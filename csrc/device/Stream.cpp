#include "device/Stream.h"

#include "device/Guard.h"

#include <atomic>
#include <unordered_map>

namespace ditorch {
namespace {
std::atomic<c10::StreamId> next_stream_id{1};
thread_local std::unordered_map<int, c10::Stream> t_current;

c10::Device dipu(int device) { return c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)); }
}  // namespace

c10::Stream defaultStream(int device) { return c10::Stream(c10::Stream::DEFAULT, dipu(device)); }

c10::Stream currentStream(int device) {
  auto it = t_current.find(device);
  return it == t_current.end() ? defaultStream(device) : it->second;
}

c10::Stream newStream(int device, int /*priority: all emu streams are equal*/) {
  checkDevice(device);
  return c10::Stream(c10::Stream::UNSAFE, dipu(device), next_stream_id++);
}

c10::Stream exchangeStream(c10::Stream stream) {
  int device = stream.device_index();
  c10::Stream previous = currentStream(device);
  t_current.insert_or_assign(device, stream);
  return previous;
}

}  // namespace ditorch
