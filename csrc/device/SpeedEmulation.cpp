#include "device/SpeedEmulation.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <ctime>

namespace ditorch {
namespace {

constexpr int64_t kSleepQuantumNs = 1000000;  // sleep's overshoot (~60 us) is small against 1 ms

// One device per process and one stream per device: the debt is the device's, not a thread's
// (autograd runs backward kernels on its own device thread).
std::atomic<int64_t> debt_ns{0};

int64_t clockNs(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Take all debt and sleep it; what sleep overshoots is credited back, so the total is exact.
void sleepOffDebt() {
  int64_t owed = debt_ns.exchange(0);
  if (owed <= 0) {
    debt_ns.fetch_add(owed);
    return;
  }
  const int64_t start = clockNs(CLOCK_MONOTONIC);
  timespec ts{time_t(owed / 1000000000), long(owed % 1000000000)};
  while (nanosleep(&ts, &ts) != 0) {
  }
  debt_ns.fetch_add(owed - (clockNs(CLOCK_MONOTONIC) - start));
}

}  // namespace

KernelClock kernelClockNow(double slowdown) {
  if (slowdown <= 1.0) return {};
  const clockid_t clock = at::get_num_threads() == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC;
  return {clockNs(clock), clock, true};
}

void chargeKernel(const KernelClock& start, double slowdown) {
  if (!start.read || slowdown <= 1.0) return;
  const int64_t host_ns = clockNs(start.clock) - start.start_ns;
  const int64_t extra = int64_t(double(host_ns) * (slowdown - 1.0));
  if (debt_ns.fetch_add(extra) + extra >= kSleepQuantumNs) sleepOffDebt();
}

void settleEmulatedTime() {
  if (debt_ns.load() > 0) sleepOffDebt();
}

int64_t emulatedTimeDebtNs() { return debt_ns.load(); }

}  // namespace ditorch
