#pragma once
// A composite charged to the emulated chip as the one kernel it stands for. While a thread's
// kernels are uncharged, the operator shim runs them without putting them on the chip's timeline
// (kernelClockNow reads no clock); the caller then charges the whole once, as the ATen kernel
// whose cost model fits it. FlexAttention's dense ops on dipu (ditorch_ext/flex_attention.py)
// are so charged as one fused attention kernel, forward and backward, as a vendor's would be.
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace ditorch {

// Whether this thread's kernels are charged one by one (the default) or not.
bool kernelsUncharged();
// Sets it for this thread; returns what it was.
bool setKernelsUncharged(bool uncharged);
// Charges, launched now, the kernel of ATen op `op` ("aten::_scaled_dot_product_flash_attention_
// for_cpu") given `tensors` as its tensor arguments, in the op's order (KernelCosts.h's model).
void chargeAs(const std::string& op, const std::vector<at::Tensor>& tensors);

}  // namespace ditorch
