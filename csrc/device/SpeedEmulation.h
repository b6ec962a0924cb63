#pragma once
// How an emulated chip is made slower than the host without holding a core.
//
// The emulated device is a timeline. A kernel on a chip with slowdown k (the profile's speed
// against the host, times the job's time scale) occupies the device for k times its host CPU
// time, from the moment the host launched it or the device came free, whichever is later.
// The host's own work (the kernel's real run, the chip-numerics recompute, Python and autograd
// between kernels) happens while the device is busy, as a host's launches do on an
// accelerator: it is charged against the device's time, not added to it. So the emulated time
// dominates and a chip runs at its profile's speed whether or not its neighbours contend for
// the cores, as long as the host work fits inside the device time (the time scale makes it
// fit when ranks outnumber cores).
//
// The host may run ahead of the device by at most a few milliseconds; past that it sleeps,
// and every synchronisation point (synchronize, a copy to the host, a collective reading the
// device's memory) sleeps until the device is idle. Ranks outnumber cores here, so a spin
// would steal the core another rank's kernel needs; a sleep leaves it to them.
//
// The host time of a kernel is the calling thread's CPU time when ATen runs one intra-op thread
// (each pipeline rank does), so a rank preempted by its neighbours is not charged for their
// work; with more intra-op threads it is the wall time, which a thread's CPU time undercounts.
// Neighbours also share caches and memory bandwidth, which lengthen a kernel's CPU time too, and
// the chip's slowdown would magnify that into device time. So a kernel is charged the least host
// time of the last 16 runs of its op on tensors of the same dtypes, shapes and layout:
// contention only ever adds host time, so the least is the kernel's own cost, the same inside a
// pipeline as when the chip was profiled alone. With a kernel cost table (`DITORCH_KERNEL_COSTS`,
// KernelCosts.h) the least is over every run any process sharing the table has seen instead.
#include <ATen/core/Tensor.h>
#include <ATen/core/function_schema.h>

#include <cstdint>
#include <ctime>

namespace ditorch {

// What a kernel's cost depends on: its op, its tensors' dtypes, shapes and contiguity, and its
// integer arguments (dims, sizes).
class KernelSignature {
 public:
  KernelSignature() = default;
  // By the op's name, not its address, so a signature means the same kernel in every process.
  explicit KernelSignature(const c10::FunctionSchema& op);
  void addTensor(const at::Tensor& t);
  void addInt(int64_t v) { mix(uint64_t(v)); }
  uint64_t value() const { return hash_; }

 private:
  void mix(uint64_t v) { hash_ ^= v + 0x9e3779b97f4a7c15ull + (hash_ << 6) + (hash_ >> 2); }
  uint64_t hash_ = 0;
};

// A kernel's start: the wall clock (when it was launched) and the clock its cost is measured on.
struct KernelClock {
  int64_t launch_ns = 0;  // CLOCK_MONOTONIC
  int64_t cost_start_ns = 0;
  clockid_t cost_clock = CLOCK_MONOTONIC;
  bool read = false;  // false: the chip is not slower than the host, so no clock was read
};

// Read before a kernel runs. Reads nothing when `slowdown` <= 1: every op pays for this read,
// and the thread CPU clock is a system call (no vDSO path), a sizeable part of a small op.
KernelClock kernelClockNow(double slowdown);
// After the kernel: put it on the device's timeline for its cost (the least host time of
// `signature`'s last runs, or of every run in the kernel cost table, this one included) times
// `slowdown`.
void chargeKernel(const KernelClock& start, double slowdown, const KernelSignature& signature);
// Put `device_ns` of device time, launched now, on the timeline and pace the host, as a kernel
// of that cost would (the timeline's own checks use it: a real kernel's host time varies).
void occupyDevice(int64_t device_ns);
// After the host's work for an op (the kernel and what follows it, such as the chip's numerics):
// sleep while the host is too far ahead of the device.
void paceHost();
// Sleep until the device is idle.
void settleEmulatedTime();
// How far the device's timeline runs ahead of now, in nanoseconds (for tests and traces).
int64_t emulatedTimeDebtNs();

}  // namespace ditorch
