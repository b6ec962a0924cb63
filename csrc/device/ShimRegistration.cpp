// Where the shim is installed. Besides the PrivateUse1 fallback (Shim.cpp), structured ops need
// a direct registration: PyTorch gives every backend a CompositeExplicitAutogradNonFunctional
// kernel for them (allocate the output through the dispatcher, then call the .out op), which
// costs dipu two extra trips through the dispatcher per op. Registering the shim for PrivateUse1
// instead sends e.g. add.Tensor straight to the CPU add.Tensor kernel, which allocates its
// output inside the kernel allocation scope: one trip, and the output is still born on dipu.
#include "device/Shim.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>

namespace ditorch {

int registerShimForStructuredOps() {
  static std::unique_ptr<torch::Library> library;
  if (library) return 0;
  library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                             __LINE__);
  int registered = 0;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1))
      continue;
    std::string qualified = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    library->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&shimKernel>());
    ++registered;
  }
  return registered;
}

}  // namespace ditorch
