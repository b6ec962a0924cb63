#include "device/AutogradDrain.h"
#include "device/Guard.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <exception>
#include <thread>

namespace ditorch {

void drainAutogradDeviceThreads(const std::vector<int64_t>& devices) {
  std::exception_ptr error;
  // A fresh thread: its thread-local state (Python modes, saved-tensor hooks) is empty, so the
  // graph task it makes holds nothing the device thread would need the GIL to drop.
  std::thread drain([&] {
    try {
      for (int64_t d : devices) {
        TORCH_CHECK(d >= 0 && d < deviceCount(), "drainAutogradDeviceThreads: device index ", d, " is out of range (", deviceCount(), " dipu devices)");
        auto x = at::zeros({1}, at::TensorOptions().device(c10::Device(c10::DeviceType::PrivateUse1,
                                                                        static_cast<c10::DeviceIndex>(d))))
                     .requires_grad_(true);
        x.mul(2).sum().backward();
      }
    } catch (...) {
      error = std::current_exception();
    }
  });
  drain.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace ditorch
