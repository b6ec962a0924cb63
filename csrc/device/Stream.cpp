#include "device/Stream.h"

#include "device/Guard.h"
#include "device/vendor/Vendor.h"

#include <atomic>
#include <unordered_map>

namespace ditorch {
namespace {
std::atomic<c10::StreamId> next_stream_id{1};
thread_local std::unordered_map<int, c10::Stream> t_current;

c10::Device dipu(int device) { return c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)); }
}  // namespace

c10::Stream toNativeStream(const c10::Stream& stream) {
  return c10::Stream(c10::Stream::UNSAFE, kernelDevice(stream.device_index()), stream.id());
}

c10::Stream toDipuStream(const c10::Stream& stream) {
  return c10::Stream(c10::Stream::UNSAFE, dipu(stream.device_index()), stream.id());
}

c10::Stream defaultStream(int device) {
  if (const auto* runtime = vendor().streamRuntime()) return toDipuStream(runtime->getDefaultStream(kernelDevice(device)));
  return c10::Stream(c10::Stream::DEFAULT, dipu(device));
}

c10::Stream currentStream(int device) {
  if (const auto* runtime = vendor().streamRuntime()) return toDipuStream(runtime->getStream(kernelDevice(device)));
  auto it = t_current.find(device);
  return it == t_current.end() ? defaultStream(device) : it->second;
}

c10::Stream newStream(int device, int priority) {
  checkDevice(device);
  if (const auto* runtime = vendor().streamRuntime())
    return toDipuStream(runtime->getNewStream(kernelDevice(device), priority));
  return c10::Stream(c10::Stream::UNSAFE, dipu(device), next_stream_id++);  // (all synchronous streams are equal)
}

c10::Stream exchangeStream(c10::Stream stream) {
  if (const auto* runtime = vendor().streamRuntime()) return toDipuStream(runtime->exchangeStream(toNativeStream(stream)));
  int device = stream.device_index();
  c10::Stream previous = currentStream(device);
  t_current.insert_or_assign(device, stream);
  return previous;
}

}  // namespace ditorch
