#include "device/AutogradThreads.h"
#include "device/Guard.h"
#include "device/vendor/Vendor.h"

#include <ATen/ops/zeros.h>
#include <c10/core/AutogradState.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <exception>
#include <thread>

namespace ditorch {

namespace detail {

void decideBackwardThread() {
  // A vendor with a stream runtime launches kernels that run on its device: keep PyTorch's
  // device threads, which feed several devices' queues at once.
  static const bool host_kernels = vendor().streamRuntime() == nullptr;
  if (!host_kernels) {
    t_backward_thread_chosen = true;
    return;
  }
  // Inside a backward (autograd's device thread, or the caller's thread running a CPU node) the
  // thread-local state is the graph task's, restored around each node: a change would steer the
  // rest of that backward and then be dropped. The thread chooses at its first op outside one.
  if (torch::autograd::get_current_graph_task_id() != -1) return;
  t_backward_thread_chosen = true;
  c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
}

}  // namespace detail

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
        // After the first dipu op on this thread, which chose the calling thread for backward:
        // this backward must reach the device thread.
        c10::AutogradState::get_tls_state().set_multithreading_enabled(true);
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
