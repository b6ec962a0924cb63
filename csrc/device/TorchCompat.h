#pragma once
// The one place where the torch releases ditorch supports differ in a C++ API it uses. ditorch
// builds against torch 2.11 through 2.15 (setup.py's install_requires; `make test-torch` builds
// and tests both ends: docs/device.md, "Supported torch versions"). Its Python twin is
// ditorch_ext/torch_compat.py.
//
// Differences inside the range, and which releases take which branch (found by diffing the headers
// of 2.11, 2.13 and 2.15 that the device layer includes):
//   - c10::CachingDeviceAllocator::DeviceStats has num_oom_rejections and
//     reserved_bytes_by_private_pools from 2.13 on, not in 2.11, and torch.cuda.memory_stats()
//     names "num_oom_rejections" from 2.13 on: dipu's memory_stats() reports it on 2.13 and later
//     (DITORCH_DEVICE_STATS_HAS_OOM_REJECTIONS), not on 2.11 and 2.12. dipu has no private pools,
//     so reserved_bytes_by_private_pools is empty and, flattened, names nothing (as on CUDA without them).
//   - ATen/autocast_mode.h's op lists name DimnameList unqualified in 2.11; 2.13 and later have no
//     DimnameList (named-tensor overloads are gone): before 2.13 Autocast.cpp includes
//     ATen/core/Dimname.h and brings at::DimnameList into scope.
//   - torch 2.15's headers need C++20 (std::bit_width, string_view::starts_with,
//     std::strong_ordering); 2.11 and 2.13 build as C++17. The top CMakeLists.txt picks the standard
//     from the torch release (C++20 from 2.14 on).
//   - DeviceGuardImplInterface::isStreamCapturing exists from 2.13 on; dipu leaves it to its
//     default (no graph capture), so nothing branches on it.
//   - c10::DeviceAllocator, the PrivateUse1 hooks, DeviceGuardImplInterface, at::getHostAllocator
//     and the dispatcher have the signatures dipu overrides and calls in every release of the range.
// A difference found later gets a DITORCH_TORCH_AT_LEAST(major, minor) branch here or where it is
// used, with a line above saying which releases take it.
#include <torch/headeronly/version.h>

#define DITORCH_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

static_assert(DITORCH_TORCH_AT_LEAST(2, 11),
              "ditorch needs torch >= 2.11 (c10::DeviceAllocator's generic memory API as dipu implements it)");

#define DITORCH_DEVICE_STATS_HAS_OOM_REJECTIONS DITORCH_TORCH_AT_LEAST(2, 13)
