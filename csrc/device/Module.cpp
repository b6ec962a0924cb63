// Python binding of the device layer (ditorch_ext._C). The only file that pulls in pybind11;
// the runtime itself lives in the other files, one concept each. torch's pybind header, not
// torch/extension.h: the binding needs pybind11 and torch's type casters, not the C++ frontend
// (nn, optim, data) that extension.h brings, which took 60% of this file's compile time.
#include "device/Allocator.h"
#include "device/AutogradThreads.h"
#include "device/ChipProfile.h"
#include "device/CompositeCharge.h"
#include "device/Generator.h"
#include "device/Guard.h"
#include "device/CpuFallback.h"
#include "device/SpeedEmulation.h"
#include "device/vendor/Vendor.h"

#include <torch/csrc/utils/pybind.h>

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

py::dict statToDict(const c10::CachingAllocator::Stat& stat) {
  py::dict d;
  d["current"] = stat.current;
  d["peak"] = stat.peak;
  d["allocated"] = stat.allocated;
  d["freed"] = stat.freed;
  return d;
}

py::dict statArrayToDict(const c10::CachingAllocator::StatArray& stats) {
  py::dict d;
  d["all"] = statToDict(stats[0]);  // StatType::AGGREGATE, SMALL_POOL, LARGE_POOL
  d["small_pool"] = statToDict(stats[1]);
  d["large_pool"] = statToDict(stats[2]);
  return d;
}

// The allocator's statistics as a nested dict, in the shape and names torch.cuda.memory_stats
// flattens ("allocated_bytes.all.current", ...).
py::dict memoryStats(int device) {
  checkDevice(device);
  const DeviceStats st = deviceAllocator().getDeviceStats(static_cast<c10::DeviceIndex>(device));
  py::dict d;
  d["num_alloc_retries"] = st.num_alloc_retries;
  d["num_ooms"] = st.num_ooms;
  d["max_split_size"] = st.max_split_size;
  d["num_sync_all_streams"] = st.num_sync_all_streams;
  d["num_device_alloc"] = st.num_device_alloc;
  d["num_device_free"] = st.num_device_free;
#if DITORCH_DEVICE_STATS_HAS_OOM_REJECTIONS
  d["num_oom_rejections"] = st.num_oom_rejections;
#endif
  d["oversize_allocations"] = statToDict(st.oversize_allocations);
  d["oversize_segments"] = statToDict(st.oversize_segments);
  d["allocation"] = statArrayToDict(st.allocation);
  d["segment"] = statArrayToDict(st.segment);
  d["active"] = statArrayToDict(st.active);
  d["inactive_split"] = statArrayToDict(st.inactive_split);
  d["allocated_bytes"] = statArrayToDict(st.allocated_bytes);
  d["reserved_bytes"] = statArrayToDict(st.reserved_bytes);
  d["active_bytes"] = statArrayToDict(st.active_bytes);
  d["inactive_split_bytes"] = statArrayToDict(st.inactive_split_bytes);
  d["requested_bytes"] = statArrayToDict(st.requested_bytes);
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
    // Without the GIL, as torch.cuda.synchronize: the caller's other threads (a pipeline
    // stage's sender handing turns on a shared link) run while it waits for the device.
    py::gil_scoped_release nogil;
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
  m.def("set_kernels_uncharged", &setKernelsUncharged, py::arg("uncharged"),
        "whether this thread's kernels go uncharged on the emulated chip (a composite charged whole); returns the previous");
  m.def("charge_as", &chargeAs, py::arg("op"), py::arg("tensors"),
        "charge, launched now, the kernel of ATen op `op` with `tensors` as its tensor arguments (CompositeCharge.h)");
  m.def("chip_slowdown", [] { return chipProfile().slowdown; }, "how many times slower than the host the active chip runs");
  m.def("memory_stats", &memoryStats, "the allocator's statistics of a device, nested as torch.cuda's");
  m.def("reset_peak_memory_stats", [](int d) {
    checkDevice(d);
    deviceAllocator().resetPeakStats(static_cast<c10::DeviceIndex>(d));
  });
  m.def("reset_accumulated_memory_stats", [](int d) {
    checkDevice(d);
    deviceAllocator().resetAccumulatedStats(static_cast<c10::DeviceIndex>(d));
  });
  m.def("mem_get_info", [](int d) { return deviceAllocator().getMemoryInfo(static_cast<c10::DeviceIndex>(d)); },
        "(free, total) bytes as the allocator reports them to torch.accelerator.get_memory_info");
  m.def("drain_autograd_device_threads", [](const std::vector<int64_t>& devices) {
        py::gil_scoped_release nogil;
        drainAutogradDeviceThreads(devices);
      }, "wait until autograd's device threads of `devices` hold no graph task (run at exit, AutogradThreads.h)");
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
