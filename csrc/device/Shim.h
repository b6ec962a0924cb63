#pragma once
// The operator shim: every ATen op on dipu tensors runs the vendor's kernel on the same storage.
// A dipu tensor is re-viewed as a tensor of the vendor's kernel device (CPU for emu) over the
// same bytes, the kernel runs, and its outputs are handed back as dipu tensors, with no copies.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <map>
#include <string>

namespace ditorch {

// A tensor of the vendor's kernel device over `t`'s storage (same bytes, sizes, strides).
at::Tensor asKernelTensor(const at::Tensor& t);

// The boxed kernel registered as the PrivateUse1 fallback (and before composites, see
// ShimRegistration.cpp).
void shimKernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

// Ops the vendor lacks run on CPU with copies: counted here, warned once per op.
std::map<std::string, int64_t> cpuFallbackCounts();
void resetCpuFallbackCounts();
// Ops to treat as missing from the vendor (comma-separated schema names, e.g. "aten::mm").
void setUnsupportedOps(const std::string& names);

// Registers the shim for ops whose composite kernel would otherwise outrank the fallback.
void registerShimBeforeComposites();

}  // namespace ditorch
