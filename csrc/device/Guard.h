#pragma once
// The current dipu device (per thread, as in CUDA) and PyTorch's DeviceGuardImpl for it.
#include <c10/core/Device.h>

namespace ditorch {

int deviceCount();
int currentDevice();
// Throws naming `device` and the valid range when it is out of range.
void setCurrentDevice(int device);
void checkDevice(int device);

}  // namespace ditorch
