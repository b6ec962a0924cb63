#include "device/CpuFallback.h"

#include "device/vendor/Vendor.h"

#include <ATen/native/CPUFallback.h>

#include <mutex>
#include <set>

namespace ditorch {
namespace {

struct FallbackRegistry {
  std::mutex mu;
  std::map<std::string, int64_t> counts;
  std::set<std::string> unsupported;
};

FallbackRegistry& registry() {
  static FallbackRegistry r;
  return r;
}

std::string qualifiedName(const c10::OperatorHandle& op) {
  const c10::FunctionSchema& schema = op.schema();
  return schema.overload_name().empty() ? schema.name() : schema.name() + "." + schema.overload_name();
}

}  // namespace

bool vendorLacks(const c10::OperatorHandle& op) {
  // A composite kernel counts: ops routed whole to the vendor (ShimRegistration.cpp) may have only that.
  return vendorLacks(op, op.hasComputedKernelForDispatchKey(kernelDispatchKey()));
}

bool vendorLacks(const c10::OperatorHandle& op, bool kernel_device_has_kernel) {
  if (!kernel_device_has_kernel) return true;
  FallbackRegistry& r = registry();
  if (r.unsupported.empty()) return false;  // racy read is fine: the set is configured at start-up
  std::lock_guard<std::mutex> lock(r.mu);
  return r.unsupported.count(qualifiedName(op)) || r.unsupported.count(op.schema().name());
}

void cpuFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  // Checked first: an op that cannot run anywhere is an error, not a counted fallback.
  TORCH_CHECK(op.hasKernelForDispatchKey(c10::DispatchKey::CPU), qualifiedName(op), " has no kernel for the '",
              vendor().name(), "' vendor and none on the CPU to fall back to");
  countCpuFallback(op);
  at::native::cpu_fallback(op, stack);
}

void countCpuFallback(const c10::OperatorHandle& op) {
  const std::string name = qualifiedName(op);
  bool first;
  {
    FallbackRegistry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    first = r.counts[name]++ == 0;
  }
  if (first)
    TORCH_WARN("ditorch: ", name, " is not supported by the '", vendor().name(),
               "' vendor; running it on the CPU with copies (warned once; see ditorch_ext.cpu_fallback_counts())");
}

std::map<std::string, int64_t> cpuFallbackCounts() {
  std::lock_guard<std::mutex> lock(registry().mu);
  return registry().counts;
}

void resetCpuFallbackCounts() {
  std::lock_guard<std::mutex> lock(registry().mu);
  registry().counts.clear();
}

void setUnsupportedOps(const std::string& names) {
  std::lock_guard<std::mutex> lock(registry().mu);
  registry().unsupported.clear();
  size_t start = 0;
  while (start <= names.size()) {
    size_t end = names.find(',', start);
    if (end == std::string::npos) end = names.size();
    std::string name = names.substr(start, end - start);
    if (!name.empty()) registry().unsupported.insert(name.find("::") == std::string::npos ? "aten::" + name : name);
    start = end + 1;
  }
}

}  // namespace ditorch
