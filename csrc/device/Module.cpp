// Python binding of the device layer (ditorch_ext._C). The only file that pulls in
// torch/extension.h; the runtime itself lives in the other files, one concept each.
#include "device/Allocator.h"
#include "device/ChipProfile.h"
#include "device/Generator.h"
#include "device/Guard.h"
#include "device/CpuFallback.h"
#include "device/SpeedEmulation.h"
#include "device/vendor/Vendor.h"

#include <torch/extension.h>

namespace ditorch {
void registerHooks();
void registerShimBeforeComposites();
}

namespace {

using namespace ditorch;

void init() {
  static bool done = false;
  if (done) return;
  done = true;
  if (vendor().redirectsKernelAllocations()) installKernelHostAllocator();
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &deviceAllocator());
  registerHooks();
  registerShimBeforeComposites();
}

py::dict memoryStats(int device) {
  checkDevice(device);
  MemoryStats s = deviceAllocator().stats(device);
  py::dict d;
  d["allocated_bytes.all.current"] = s.allocated;
  d["allocated_bytes.all.peak"] = s.peak_allocated;
  d["reserved_bytes.all.current"] = s.reserved;
  d["reserved_bytes.all.peak"] = s.peak_reserved;
  d["num_alloc_retries"] = 0;
  d["num_ooms"] = s.num_ooms;
  d["allocation.all.allocated"] = s.num_allocs;
  d["allocation.all.freed"] = s.num_frees;
  d["num_cache_hits"] = s.num_cache_hits;
  return d;
}

DipuGenerator& generatorOf(int device) {
  return *static_cast<DipuGenerator*>(defaultGenerator(device).unsafeGetGeneratorImpl());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ditorch device layer: the dipu runtime, operator shim and chip profiles";
  m.def("_init", &init, "install the allocator and hooks (idempotent)");
  m.def("vendor_name", [] { return std::string(vendor().name()); });
  m.def("host_addressable", [] { return vendor().hostAddressable(); });
  m.def("asynchronous", [] { return vendor().streamRuntime() != nullptr; });
  m.def("kernel_device_type", [] { return c10::DeviceTypeName(vendor().kernelDeviceType(), /*lower_case=*/true); });

  m.def("device_count", [] { return deviceCount(); });
  m.def("current_device", [] { return currentDevice(); });
  m.def("set_device", [](int d) { setCurrentDevice(d); });
  m.def("synchronize", [](int d) {
    checkDevice(d);
    vendor().synchronize(d);
  });
  m.def("emulated_time_debt_ns", &emulatedTimeDebtNs, "device time owed by the emulated chip, not yet slept off");
  m.def(
      "set_chip_profile",
      [](const std::string& name, int64_t memory_bytes, double slowdown, int matmul_mantissa_bits, int accumulator_bits,
         int accumulation_block, bool round_toward_zero, int special_function_bits, bool flush_denormals) {
        setChipProfile(ChipProfile{name, memory_bytes, slowdown,
                                   Numerics{matmul_mantissa_bits, accumulator_bits, accumulation_block, round_toward_zero,
                                            special_function_bits, flush_denormals}});
      },
      py::arg("name"), py::arg("memory_bytes"), py::arg("slowdown"), py::arg("matmul_mantissa_bits"),
      py::arg("accumulator_bits"), py::arg("accumulation_block"), py::arg("round_toward_zero"),
      py::arg("special_function_bits"), py::arg("flush_denormals"));
  m.def("occupy_device", [](double seconds) { occupyDevice(int64_t(seconds * 1e9)); },
        "put `seconds` of device time, launched now, on the emulated device's timeline (as a kernel would)");
  m.def("chip_slowdown", [] { return chipProfile().slowdown; }, "how many times slower than the host the active chip runs");
  m.def("memory_stats", &memoryStats);
  m.def("reset_peak_memory_stats", [](int d) {
    checkDevice(d);
    deviceAllocator().resetPeakStats(d);
  });
  m.def("empty_cache", [] { deviceAllocator().emptyCache(); });
  m.def("manual_seed", [](int d, uint64_t seed) { generatorOf(d).set_current_seed(seed); });
  m.def("seed", [](int d) { return generatorOf(d).seed(); });
  m.def("initial_seed", [](int d) { return generatorOf(d).current_seed(); });
  m.def("get_rng_state", [](int d) { return at::Tensor(generatorOf(d).get_state()); });
  m.def("set_rng_state", [](int d, const at::Tensor& state) { generatorOf(d).set_state(*state.unsafeGetTensorImpl()); });
  m.def("cpu_fallback_counts", &cpuFallbackCounts);
  m.def("reset_cpu_fallback_counts", &resetCpuFallbackCounts);
  m.def("set_unsupported_ops", &setUnsupportedOps, "comma-separated op names the vendor should treat as missing");
}
