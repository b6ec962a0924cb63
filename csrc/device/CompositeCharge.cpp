#include "device/CompositeCharge.h"

#include "device/ChipProfile.h"
#include "device/SpeedEmulation.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace ditorch {
namespace {
thread_local bool t_uncharged = false;
}  // namespace

bool kernelsUncharged() { return t_uncharged; }

bool setKernelsUncharged(bool uncharged) {
  const bool was = t_uncharged;
  t_uncharged = uncharged;
  return was;
}

void chargeAs(const std::string& op, const std::vector<at::Tensor>& tensors) {
  const double time_scale = chipProfile().slowdown;
  const bool was = setKernelsUncharged(false);
  const KernelClock start = kernelClockNow(time_scale);
  setKernelsUncharged(was);
  if (!start.read) return;
  const c10::OperatorHandle handle = c10::Dispatcher::singleton().findSchemaOrThrow(op.c_str(), "");
  KernelSignature signature(handle.schema());
  for (const at::Tensor& t : tensors) signature.addTensor(t);
  chargeKernel(start, time_scale, signature);
  paceHost();
}

}  // namespace ditorch
