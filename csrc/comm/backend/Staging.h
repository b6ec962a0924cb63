// Host views of tensors: what the transports read and write.
//
// CPU tensors and device tensors whose memory the host can address (the emu `dipu` vendor) are
// used in place. Other device tensors (a real vendor: dipu over cuda, or cuda itself) and
// non-contiguous tensors are staged through a contiguous host copy (pinned where the device
// copies by DMA: cuda, an asynchronous dipu vendor) and copied back after the op. Copies to and from the device are synchronous on the host, and a collective's copies,
// made on the collective thread, first wait for the caller's stream at the point of the call
// (StreamFence): no read before the producing kernel finishes, and the caller goes on writing
// the tensor only after wait() (as with NCCL), when the copy back has completed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <memory>

namespace dicomm {

struct StagingPolicy {
  bool privateUse1HostAddressable = false;  // torch.dipu.is_host_addressable()
  bool forceStaging = false;                 // DICOMM_FORCE_STAGING=1: stage every device tensor
  // torch.dipu.is_asynchronous(): dipu copies are DMA on the vendor's streams, so staging
  // buffers are pinned (a synchronous vendor copies on the host; pinning would only cost an mlock).
  bool privateUse1Asynchronous = false;

  // Whether `tensor`'s memory is read and written through a host copy.
  bool stages(const at::Tensor& tensor) const;
};

// The point in the caller's current stream where a collective was issued. The collective thread
// makes its own current stream wait for it before its first copy of the device tensors (nothing
// is recorded for tensors used in place).
class StreamFence {
 public:
  StreamFence() = default;
  StreamFence(const at::Tensor& tensor, const StagingPolicy& policy);
  // Makes this thread's current stream of the tensor's device wait for the fence.
  void wait() const;

 private:
  std::shared_ptr<c10::Event> event_;
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
