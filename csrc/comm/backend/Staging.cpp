#include "comm/backend/Staging.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace dicomm {

bool StagingPolicy::stages(const at::Tensor& tensor) const {
  const auto type = tensor.device().type();
  return type != at::kCPU && !(type == at::kPrivateUse1 && privateUse1HostAddressable && !forceStaging);
}

StreamFence::StreamFence(const at::Tensor& tensor, const StagingPolicy& policy) {
  if (!tensor.defined() || !policy.stages(tensor)) return;
  const c10::Device device = tensor.device();
  event_ = std::make_shared<c10::Event>(device.type());
  event_->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
}

void StreamFence::wait() const {
  if (!event_) return;
  const c10::Device device(event_->device_type(), event_->device_index());
  event_->block(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
}

HostView::HostView(const at::Tensor& tensor, const StagingPolicy& policy, bool load)
    : original_(tensor) {
  const auto type = tensor.device().type();
  if (!policy.stages(tensor)) {
    contiguous_ = tensor.is_contiguous() ? tensor : tensor.contiguous();
    staged_ = !tensor.is_contiguous();
    if (type == at::kCPU) {
      host_ = contiguous_;
    } else {
      // The device's memory is host memory: a CPU tensor over the same bytes, read or written
      // once the device's queued work on it is done.
      const c10::impl::VirtualGuardImpl guard(type);
      guard.synchronizeStream(guard.getStream(tensor.device()));
      host_ = at::from_blob(contiguous_.data_ptr(), contiguous_.sizes(),
                            at::TensorOptions().dtype(contiguous_.scalar_type()).device(at::kCPU));
    }
    return;
  }
  staged_ = true;
  host_ = at::empty(tensor.sizes(), at::TensorOptions()
                                        .dtype(tensor.scalar_type())
                                        .device(at::kCPU)
                                        .pinned_memory(type == at::kCUDA ||
                                                       (type == at::kPrivateUse1 && policy.privateUse1Asynchronous)));
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
