#include "device/SpeedEmulation.h"

#include "device/CompositeCharge.h"
#include "device/KernelCosts.h"

#include <torch/library.h>

#include <algorithm>
#include <ctime>
#include <mutex>

namespace ditorch {
namespace {

// Kernels the host may have queued on the device before it sleeps, as an accelerator's launch
// queue holds about a thousand (a CUDA stream's launches block past that); it then sleeps until
// half of them have run. A bound in kernels, not in time: a stage's forward queues its surplus of
// device time over host time, and its backward, denser in matmuls that the host computes at
// launch (a chip's narrow accumulation costs the host more than the chip), spends it. A few
// milliseconds of lead cannot carry that, and the device would idle on a host that keeps up over
// the step.
constexpr uint64_t kQueueDepth = 1024;

int64_t monotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// One device per process and one stream per device: the timeline is the device's, not a
// thread's (autograd runs backward kernels on its own device thread).
class DeviceTimeline {
 public:
  // Queue `busy_ns` of device time launched at `launch_ns`; returns when the device will be idle.
  int64_t enqueue(int64_t launch_ns, int64_t busy_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    // The device idled from idle_at_ to this launch: the host was late, unless it waited at a
    // synchronisation point since the last kernel (a real device idles there too).
    if (!synced_ && idle_at_ns_ > 0 && launch_ns > idle_at_ns_) {
      stats_.host_late_ns += launch_ns - idle_at_ns_;
      ++stats_.late_kernels;
    }
    synced_ = false;
    ++stats_.kernels;
    stats_.device_busy_ns += busy_ns;
    idle_at_ns_ = std::max(idle_at_ns_, launch_ns) + busy_ns;
    ends_ns_[launched_++ % kQueueDepth] = idle_at_ns_;
    return idle_at_ns_;
  }
  // When the launch queue is full at `now_ns` (the kernel launched kQueueDepth ago has not run
  // yet), the time by which half of it will have run; 0 otherwise.
  int64_t drainDeadline(int64_t now_ns) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (launched_ < kQueueDepth || ends_ns_[launched_ % kQueueDepth] <= now_ns) return 0;
    return ends_ns_[(launched_ - kQueueDepth / 2) % kQueueDepth];
  }
  int64_t idleAt() const {
    std::lock_guard<std::mutex> lock(mu_);
    return idle_at_ns_;
  }
  void markSynced() {
    std::lock_guard<std::mutex> lock(mu_);
    synced_ = true;
  }
  // A timing fence at `now_ns`: an idle device waited for the host since its last kernel, and
  // waits again from now until the next launch (enqueue counts that, as synced_ stays false).
  // Returns when the device will be idle.
  int64_t fence(int64_t now_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    if (idle_at_ns_ > 0 && idle_at_ns_ < now_ns) {
      stats_.host_late_ns += now_ns - idle_at_ns_;
      idle_at_ns_ = now_ns;
    }
    synced_ = false;
    return idle_at_ns_;
  }
  EmulationStats stats(bool reset) {
    std::lock_guard<std::mutex> lock(mu_);
    const EmulationStats s = stats_;
    if (reset) stats_ = EmulationStats{};
    return s;
  }

 private:
  mutable std::mutex mu_;
  int64_t idle_at_ns_ = 0;  // CLOCK_MONOTONIC
  uint64_t launched_ = 0;
  int64_t ends_ns_[kQueueDepth] = {};  // when each of the last kQueueDepth kernels ends
  bool synced_ = true;
  EmulationStats stats_;
};

DeviceTimeline& timeline() {
  static DeviceTimeline t;
  return t;
}

void sleepUntil(int64_t deadline_ns) {
  timespec ts{time_t(deadline_ns / 1000000000), long(deadline_ns % 1000000000)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) != 0) {
  }
}

}  // namespace

int64_t TensorShape::bytes() const { return numel * int64_t(c10::elementSize(dtype)); }

KernelSignature::KernelSignature(const c10::FunctionSchema& op) : name_(&op.name()) {}

const std::string& KernelSignature::name() const {
  static const std::string none;
  return name_ ? *name_ : none;
}

void KernelSignature::addTensor(const at::Tensor& t) {
  TensorShape shape;
  if (t.defined()) {
    shape.dtype = t.scalar_type();
    shape.numel = t.numel();
    const auto sizes = t.sizes();
    shape.dims = std::min<int>(int(sizes.size()), TensorShape::kMaxDims);
    for (size_t d = 0; d < sizes.size(); ++d) {
      const int kept = std::min<int>(int(d), TensorShape::kMaxDims - 1);
      shape.sizes[kept] = d < TensorShape::kMaxDims ? sizes[d] : shape.sizes[kept] * sizes[d];
    }
    const int64_t bytes = shape.bytes();
    input_bytes_ += bytes;
    largest_bytes_ = std::max(largest_bytes_, bytes);
  }
  if (tensors_ < kMaxShapes) shapes_[tensors_] = shape;
  ++tensors_;
}

void KernelSignature::addInt(int64_t v) {
  if (ints_count_ < kMaxInts) ints_[ints_count_] = v;
  ++ints_count_;
}

KernelClock kernelClockNow(double time_scale) {
  if (time_scale <= 0 || kernelsUncharged()) return {};
  return {monotonicNs(), true};
}

void chargeKernel(const KernelClock& start, double time_scale, const KernelSignature& signature) {
  if (!start.read || time_scale <= 0) return;
  const double seconds = chipSeconds(kernelWork(signature), chipDatasheet());
  timeline().enqueue(start.launch_ns, int64_t(seconds * time_scale * 1e9));
}

void paceHost() {
  if (const int64_t deadline = timeline().drainDeadline(monotonicNs())) sleepUntil(deadline);
}

void occupyDevice(int64_t device_ns) {
  timeline().enqueue(monotonicNs(), device_ns);
  paceHost();
}

void settleEmulatedTime() {
  const int64_t idle_at = timeline().idleAt();
  if (idle_at > monotonicNs()) sleepUntil(idle_at);
  timeline().markSynced();
}

void fenceEmulatedTime() {
  const int64_t idle_at = timeline().fence(monotonicNs());
  if (idle_at > monotonicNs()) sleepUntil(idle_at);
}

int64_t emulatedTimeDebtNs() { return std::max<int64_t>(0, timeline().idleAt() - monotonicNs()); }

EmulationStats emulationStats(bool reset) { return timeline().stats(reset); }

}  // namespace ditorch

// Read from Python as torch.ops.ditorch_emu.* (ditorch_ext/chip.py).
TORCH_LIBRARY_FRAGMENT(ditorch_emu, m) {
  m.def("emulation_stats(bool reset=False) -> int[]", [](bool reset) {
    const ditorch::EmulationStats s = ditorch::emulationStats(reset);
    return std::vector<int64_t>{s.kernels, s.device_busy_ns, s.host_late_ns, s.late_kernels};
  });
  m.def("fence_device_time() -> ()", [] { ditorch::fenceEmulatedTime(); });
}
