#include "comm/backend/Staging.h"

namespace dicomm {

HostView::HostView(const at::Tensor& tensor, const StagingPolicy& policy, bool load)
    : original_(tensor) {
  const auto type = tensor.device().type();
  const bool hostMemory =
      type == at::kCPU ||
      (type == at::kPrivateUse1 && policy.privateUse1HostAddressable && !policy.forceStaging);
  if (hostMemory) {
    contiguous_ = tensor.is_contiguous() ? tensor : tensor.contiguous();
    staged_ = !tensor.is_contiguous();
    if (type == at::kCPU) {
      host_ = contiguous_;
    } else {
      // The device's memory is host memory: a CPU tensor over the same bytes.
      host_ = at::from_blob(contiguous_.data_ptr(), contiguous_.sizes(),
                            at::TensorOptions().dtype(contiguous_.scalar_type()).device(at::kCPU));
    }
    return;
  }
  staged_ = true;
  host_ = at::empty(tensor.sizes(), at::TensorOptions()
                                        .dtype(tensor.scalar_type())
                                        .device(at::kCPU)
                                        .pinned_memory(type == at::kCUDA));
  if (load) host_.copy_(tensor);
}

void HostView::store() {
  if (!staged_) return;
  if (contiguous_.defined() && !original_.device().is_cpu()) {
    original_.copy_(contiguous_);  // host_ aliased this device-side contiguous copy
  } else {
    original_.copy_(host_);
  }
}

}  // namespace dicomm
