#include "device/SpeedEmulation.h"

#include "device/KernelCosts.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace ditorch {
namespace {

// The host may run this far ahead of the device before it sleeps, and sleeps down to half of it:
// host work between kernels is hidden while it stays within the device's time and the remaining
// lead (as behind an accelerator's launch queue), so a rank preempted for a few milliseconds by
// its neighbours does not fall behind its profile; a sleep's overshoot (~60 us) is small against it.
constexpr int64_t kMaxLeadNs = 10000000;
constexpr int64_t kLeadAfterSleepNs = kMaxLeadNs / 2;

int64_t clockNs(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// One device per process and one stream per device: the timeline is the device's, not a
// thread's (autograd runs backward kernels on its own device thread).
class DeviceTimeline {
 public:
  // Queue `busy_ns` of device time launched at `launch_ns`; returns when the device will be idle.
  int64_t enqueue(int64_t launch_ns, int64_t busy_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    idle_at_ns_ = std::max(idle_at_ns_, launch_ns) + busy_ns;
    return idle_at_ns_;
  }
  int64_t idleAt() const {
    std::lock_guard<std::mutex> lock(mu_);
    return idle_at_ns_;
  }

 private:
  mutable std::mutex mu_;
  int64_t idle_at_ns_ = 0;  // CLOCK_MONOTONIC
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

// The least host time of a kernel signature's last kWindow runs. A window, not all history: the
// least of more samples is lower, so a pipeline running a kernel thousands of times would be
// charged less for it than the profile that ran it dozens. Per thread (the autograd thread runs
// the backward's kernels), so no lock; bounded, as a model's distinct kernels are a few hundred.
class RecentHostTimes {
 public:
  static constexpr int kWindow = 16;
  int64_t add(int64_t host_ns) {
    times_[next_] = host_ns;
    next_ = (next_ + 1) % kWindow;
    count_ = std::min(count_ + 1, kWindow);
    return *std::min_element(times_, times_ + count_);
  }

 private:
  int64_t times_[kWindow] = {};
  int next_ = 0, count_ = 0;
};

int64_t leastRecentHostTime(uint64_t signature, int64_t host_ns) {
  const int64_t known = leastKnownHostTime(signature, host_ns);
  if (known >= 0) return known;
  constexpr size_t kMaxSignatures = 1 << 14;
  thread_local std::unordered_map<uint64_t, RecentHostTimes> recent;
  if (recent.size() >= kMaxSignatures) recent.clear();
  return recent[signature].add(host_ns);
}

}  // namespace

KernelSignature::KernelSignature(const c10::FunctionSchema& op) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of "name.overload"
  for (const std::string* part : {&op.name(), &op.overload_name()}) {
    for (const char c : *part) h = (h ^ uint8_t(c)) * 0x100000001b3ull;
    h = (h ^ uint8_t('.')) * 0x100000001b3ull;
  }
  mix(h);
}

void KernelSignature::addTensor(const at::Tensor& t) {
  if (!t.defined()) return mix(0);
  mix(uint64_t(t.scalar_type()) << 1 | uint64_t(t.is_contiguous()));
  for (const int64_t size : t.sizes()) mix(uint64_t(size));
}

KernelClock kernelClockNow(double slowdown) {
  if (slowdown <= 1.0) return {};
  const clockid_t clock = at::get_num_threads() == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC;
  const int64_t launch = clockNs(CLOCK_MONOTONIC);
  return {launch, clock == CLOCK_MONOTONIC ? launch : clockNs(clock), clock, true};
}

void chargeKernel(const KernelClock& start, double slowdown, const KernelSignature& signature) {
  if (!start.read || slowdown <= 1.0) return;
  const int64_t host_ns = leastRecentHostTime(signature.value(), clockNs(start.cost_clock) - start.cost_start_ns);
  timeline().enqueue(start.launch_ns, int64_t(double(host_ns) * slowdown));
}

void paceHost() {
  const int64_t idle_at = timeline().idleAt();
  if (idle_at - clockNs(CLOCK_MONOTONIC) > kMaxLeadNs) sleepUntil(idle_at - kLeadAfterSleepNs);
}

void occupyDevice(int64_t device_ns) {
  timeline().enqueue(clockNs(CLOCK_MONOTONIC), device_ns);
  paceHost();
}

void settleEmulatedTime() {
  const int64_t idle_at = timeline().idleAt();
  if (idle_at > clockNs(CLOCK_MONOTONIC)) sleepUntil(idle_at);
}

int64_t emulatedTimeDebtNs() { return std::max<int64_t>(0, timeline().idleAt() - clockNs(CLOCK_MONOTONIC)); }

}  // namespace ditorch
