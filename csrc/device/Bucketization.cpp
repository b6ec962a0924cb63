// searchsorted and bucketize on dipu: the vendor's kernel, with the CPU's performance warnings
// given by dipu itself.
//
// PyTorch's CPU and CUDA kernels each warn once per program when a tensor is non-contiguous
// (TORCH_WARN_ONCE in a header both compile: one flag per library). dipu runs the vendor's
// kernel, on the emu vendor the CPU's, whose flag a CPU call may already have spent, so dipu
// would stay silent where a device of its own warns. Here dipu warns with flags of its own, in the
// kernel's words, and hands the kernel contiguous tensors (the copies it would make itself).
#include "device/Shim.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <string>

namespace ditorch {
namespace {

void warnNonContiguous(const std::string& argument) {
  if (argument == "self") {
    TORCH_WARN_ONCE("torch.searchsorted(): input value tensor is non-contiguous, this will lower the performance due "
                    "to extra data copy when converting non-contiguous tensor to contiguous, please use contiguous "
                    "input value tensor if possible. This message will only appear once per program.");
  } else if (argument == "sorter") {
    TORCH_WARN_ONCE("torch.searchsorted(): sorter tensor is non-contiguous, this will lower the performance due to "
                    "extra data copy when converting non-contiguous tensor to contiguous, please use contiguous "
                    "sorter tensor if possible. This message will only appear once per program.");
  } else {  // sorted_sequence, boundaries
    TORCH_WARN_ONCE("torch.searchsorted(): boundary tensor is non-contiguous, this will lower the performance due to "
                    "extra data copy when converting non-contiguous tensor to contiguous, please use contiguous "
                    "boundary tensor if possible. This message will only appear once per program.");
  }
}

void bucketizationKernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t base = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& v = (*stack)[base + i];
    const bool written = args[i].alias_info() && args[i].alias_info()->isWrite();
    if (written || !v.isTensor()) continue;
    const at::Tensor t = v.toTensor();
    if (!t.defined() || t.dim() == 0 || t.is_contiguous()) continue;
    warnNonContiguous(args[i].name());
    v = t.contiguous();
  }
  shimKernel(op, keys, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"searchsorted.Tensor", "searchsorted.Tensor_out", "searchsorted.Scalar",
                           "searchsorted.Scalar_out", "bucketize.Tensor", "bucketize.Tensor_out"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&bucketizationKernel>());
}

}  // namespace ditorch
