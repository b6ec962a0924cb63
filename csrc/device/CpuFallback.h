#pragma once
// Ops the vendor has no kernel for run on the CPU with copies (PyTorch's cpu_fallback): counted
// per op and warned once, so a user sees what their model leaves to the host.
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <map>
#include <string>

namespace ditorch {

// Whether `op` must fall back: no kernel (composites count) for the vendor's kernel device, or
// named by setUnsupportedOps.
bool vendorLacks(const c10::OperatorHandle& op);
// The same, where whether the kernel device has a kernel for `op` is already known (the unboxed
// shim asks that once per op).
bool vendorLacks(const c10::OperatorHandle& op, bool kernel_device_has_kernel);
// Runs `op` on the CPU with copies; fails naming the op when the CPU has no kernel either.
void cpuFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// Counts one run of `op` on the CPU (and warns the first time).
void countCpuFallback(const c10::OperatorHandle& op);

std::map<std::string, int64_t> cpuFallbackCounts();
void resetCpuFallbackCounts();
// Ops to treat as missing from the vendor (comma-separated schema names, e.g. "aten::mm").
void setUnsupportedOps(const std::string& names);

}  // namespace ditorch
