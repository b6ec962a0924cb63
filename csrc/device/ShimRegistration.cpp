// Where the operator shim is installed.
#include "device/Shim.h"

#include "device/vendor/Vendor.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <set>
#include <vector>

namespace ditorch {

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&shimKernel>()); }

namespace {
std::vector<c10::RegistrationHandleRAII>& handles() {
  static std::vector<c10::RegistrationHandleRAII> h;
  return h;
}
}  // namespace

// The backend fallback above only sees ops that have no composite kernel: ATen gives many ops both
// a kernel per device and a CompositeExplicitAutograd[NonFunctional] one for devices without, and
// the composite outranks a fallback. Left alone, dipu would decompose such an op instead of running
// the vendor's kernel: native_layer_norm became ATen's math version (other numerics than the
// vendor's), structured ops went out= by out=, and the convolution entry points, whose composites
// pick a backend by device type, picked convolution_overrideable, which no vendor has. So the shim
// is also registered, explicitly, for every op that has a kernel for the vendor's device and a
// composite, and for the convolution entry points: the vendor then runs them whole (its own
// backend choice, in one re-dispatch). Ops with a CompositeImplicitAutograd kernel are left out
// (their autograd comes from that decomposition) unless autograd has a formula of their own and the
// vendor a kernel. Ops defined by libraries loaded later keep the
// composite.
//
// Structured ops gain too: their generic composite allocates the output through the dispatcher
// and calls the .out op (three dispatcher trips); the vendor's kernel takes one.
void registerShimBeforeComposites() {
  if (!handles().empty()) return;
  c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
  const c10::DispatchKey kernel_key = kernelDispatchKey();
  // Composites that choose a kernel by the device type (or refuse other types) themselves: the
  // convolution entry points, and mode's out= overload (which torch.mode and torch.mode(out=)
  // reach), whose composite checks for CPU, CUDA or XPU before its DispatchStub. Through the
  // shim, the composite runs on the vendor's device type.
  const std::set<std::string> device_selecting = {"aten::convolution", "aten::convolution_backward",
                                                  "aten::_convolution", "aten::mode.values"};
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    std::optional<c10::OperatorHandle> op = dispatcher.findOp(name);
    if (!op || !op->hasSchema() || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
    const bool vendor_kernel = op->hasKernelForDispatchKey(kernel_key);
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
      // A decomposition for devices without a kernel whose autograd is its own formula
      // (silu_backward, mish_backward, native_channel_shuffle): the vendor's kernel is one op where
      // the decomposition is five (silu_backward in bf16 cost a LLaMA step 4% over native cpu).
      if (vendor_kernel && op->hasKernelForDispatchKey(c10::DispatchKey::Autograd))
        handles().push_back(dispatcher.registerImpl(name, c10::DispatchKey::PrivateUse1,
                                                    c10::KernelFunction::makeFromBoxedFunction<&shimKernel>(),
                                                    std::nullopt, nullptr,
                                                    "ditorch shim: the vendor's kernel before ATen's decomposition"));
      continue;
    }
    const bool composite = op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
                           op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
    const std::string full = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    const bool route = (composite && vendor_kernel) || device_selecting.count(full);
    if (!route) continue;
    handles().push_back(dispatcher.registerImpl(name, c10::DispatchKey::PrivateUse1,
                                                c10::KernelFunction::makeFromBoxedFunction<&shimKernel>(), std::nullopt,
                                                nullptr, "ditorch shim: the vendor's kernel before ATen's composite"));
  }
}

}  // namespace ditorch
