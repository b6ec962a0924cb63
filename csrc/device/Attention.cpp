// Which scaled_dot_product_attention backend a dipu tensor takes.
//
// torch.nn.functional.scaled_dot_product_attention asks a per-device stub which fused kernel to
// use and falls back to the math path (matmul, softmax, dropout, matmul: a dozen ops forward and
// more backward, each a trip through the shim) for a device that registers none. dipu registers
// one: it takes what the vendor's kernel device would take for the same inputs, so a small-op
// model on the host chip runs the CPU's fused flash attention as the CPU does, one shim trip
// forward and one backward.
//
// Two exceptions keep the math path:
//   - a chip with its own numerics: they are reproduced op by op (matmul accumulation, softmax
//     precision; ChipNumerics.h), and a fused kernel would hide its attention from them;
//   - a kernel device other than the CPU: scaled_dot_product_attention calls the CPU flash entry
//     point for every non-CUDA device, so only the CPU's flash choice maps onto a dipu kernel.
//     A vendor with its own fused attention registers it through the overrideable backend.
#include "device/ChipProfile.h"
#include "device/KernelArguments.h"
#include "device/vendor/Vendor.h"

#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>

namespace ditorch {
namespace {

int64_t dipuFusedSdpChoice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                           std::optional<double> scale, bool enable_gqa) {
  constexpr auto kMath = static_cast<int64_t>(sdp::SDPBackend::math);
  if (vendor().kernelDeviceType() != c10::DeviceType::CPU || chipProfile().numerics.any()) return kMath;
  std::optional<at::Tensor> kernel_mask;
  if (attn_mask && attn_mask->defined()) kernel_mask = isDipu(*attn_mask) ? asKernelTensor(*attn_mask) : *attn_mask;
  // Straight to the kernel device's choice (a redispatch: a Python dispatch mode such as
  // autocompare must not see this internal query as an op of the user's program).
  const int64_t choice = at::_ops::_fused_sdp_choice::redispatch(
      c10::DispatchKeySet(kernelDispatchKey()), asKernelTensor(query), asKernelTensor(key), asKernelTensor(value),
      kernel_mask, dropout_p, is_causal, scale, enable_gqa);
  return choice == static_cast<int64_t>(sdp::SDPBackend::flash_attention) ? choice : kMath;
}

}  // namespace
}  // namespace ditorch

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &ditorch::dipuFusedSdpChoice)
}  // namespace at::native
