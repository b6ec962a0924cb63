#pragma once
// The operator shim: every ATen op on dipu tensors runs the vendor's kernel on the same storage.
// Each concept has its own file: which device an op runs on and what it refuses (here), how its
// arguments and results are re-viewed (KernelArguments), what the vendor lacks (CpuFallback), how
// a chip's arithmetic differs (ChipNumerics) and how fast it is (SpeedEmulation).
#include <ATen/core/dispatch/Dispatcher.h>

namespace ditorch {

// The boxed kernel registered as the PrivateUse1 fallback (and before composites, see
// ShimRegistration.cpp).
void shimKernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

// Registers the shim for ops whose composite kernel would otherwise outrank the fallback.
void registerShimBeforeComposites();

}  // namespace ditorch
