#pragma once
// How an emulated chip is made slower than the host without holding a core.
//
// A kernel on a chip with slowdown k should take k times its host time. The extra (k - 1) parts
// accrue as the device's time debt, which is slept off once it reaches a millisecond and in full
// at every synchronisation point (synchronize, a copy to the host). Ranks outnumber cores here,
// so a spin would steal the core another rank's kernel needs and the emulated speeds would stop
// meaning anything; a sleep leaves the core to them.
//
// The host time of a kernel is the calling thread's CPU time when ATen runs one intra-op thread
// (each pipeline rank does), so a rank preempted by its neighbours is not charged for their
// work; with more intra-op threads it is the wall time, which a thread's CPU time undercounts.
#include <cstdint>
#include <ctime>

namespace ditorch {

// A kernel's start on the one clock its charge is measured with.
struct KernelClock {
  int64_t start_ns = 0;
  clockid_t clock = CLOCK_MONOTONIC;
  bool read = false;  // false: the chip is not slower than the host, so no clock was read
};

// Read before a kernel runs. Reads nothing when `slowdown` <= 1: every op pays for this read,
// and the thread CPU clock is a system call (no vDSO path), a sizeable part of a small op.
KernelClock kernelClockNow(double slowdown);
// After the kernel: charge its host time times (slowdown - 1) and sleep off whole milliseconds.
void chargeKernel(const KernelClock& start, double slowdown);
// Sleep off all outstanding debt (the device is idle once this returns).
void settleEmulatedTime();
// Outstanding debt in nanoseconds (for tests and traces).
int64_t emulatedTimeDebtNs();

}  // namespace ditorch
