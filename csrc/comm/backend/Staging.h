// Host views of tensors: what the transports read and write.
//
// CPU tensors and device tensors whose memory the host can address (the emu `dipu` vendor) are
// used in place. Other device tensors (a real vendor, cuda) and non-contiguous tensors are staged
// through a contiguous host copy (pinned when the device is cuda) and copied back after the op.
#pragma once

#include <ATen/ATen.h>

namespace dicomm {

struct StagingPolicy {
  bool privateUse1HostAddressable = false;  // torch.dipu.is_host_addressable()
  bool forceStaging = false;                 // DICOMM_FORCE_STAGING=1: stage every device tensor
};

class HostView {
 public:
  // `load`: copy the tensor's values into the host view (false for pure outputs).
  HostView(const at::Tensor& tensor, const StagingPolicy& policy, bool load);
  void* data() const { return host_.data_ptr(); }
  size_t nbytes() const { return host_.nbytes(); }
  size_t numel() const { return static_cast<size_t>(host_.numel()); }
  c10::ScalarType dtype() const { return host_.scalar_type(); }
  const at::Tensor& host() const { return host_; }
  bool staged() const { return staged_; }
  // Copy the host view back into the tensor (no-op when it was used in place).
  void store();

 private:
  at::Tensor original_;
  at::Tensor contiguous_;  // device-side contiguous copy when the original is not contiguous
  at::Tensor host_;
  bool staged_ = false;
};

}  // namespace dicomm
