#pragma once
// How an emulated chip runs at its datasheet's speed without holding a core.
//
// The emulated device is a timeline. A kernel occupies it for the chip's time for that kernel
// (the roofline of its FLOPs and bytes on the chip's datasheet plus the launch latency,
// KernelCosts.h) times the job's time scale, from the moment the host launched it or the device
// came free, whichever is later. The host's own time never enters: a chip takes as long on a
// fast host as on a slow one. The host's work (the kernel's real run, the chip-numerics
// recompute, Python and autograd between kernels) happens while the device is busy, as a host's
// launches do on an accelerator: it is charged against the device's time, not added to it.
//
// The host only has to keep up. When its work between two kernels outlasts the device's queue,
// the device sits idle waiting for it, and the run is slower than the chip: that idle time is
// counted (emulationStats(): `host_late_ns`) so that a run can say by how much its host fell
// behind; the job's time scale is chosen so that it does not (ditorch_ext/profiles.py). A wait
// after a synchronisation point (a copy to the host, a collective) is not the host's lateness:
// a real device also idles while its host waits for data.
//
// The host may queue up to a thousand kernels ahead of the device, as on an accelerator; past
// that it sleeps, and every synchronisation point (synchronize, a copy to the host, a collective
// reading the device's memory) sleeps until the device is idle. Ranks outnumber cores here, so a
// spin would steal the core another rank's kernel needs; a sleep leaves it to them.
#include <ATen/core/Tensor.h>
#include <ATen/core/function_schema.h>

#include <cstdint>
#include <string>

namespace ditorch {

// The shape and dtype of one tensor argument, as a kernel's cost needs them.
struct TensorShape {
  static constexpr int kMaxDims = 6;
  int dims = 0;  // sizes beyond kMaxDims are folded into the last kept one
  int64_t sizes[kMaxDims] = {};
  int64_t numel = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t bytes() const;
  int64_t size(int d) const { return sizes[d < 0 ? dims + d : d]; }
};

// What a kernel's cost depends on: its op, its tensors' dtypes and shapes and its integer
// arguments (dims, sizes, strides), in the op's argument order.
class KernelSignature {
 public:
  static constexpr int kMaxShapes = 6;
  static constexpr int kMaxInts = 16;

  KernelSignature() = default;
  explicit KernelSignature(const c10::FunctionSchema& op);
  void addTensor(const at::Tensor& t);
  void addInt(int64_t v);

  // "aten::mm" (empty for a default-constructed signature)
  const std::string& name() const;
  // Tensor arguments seen (undefined optional ones included); shape(i) for i < kMaxShapes.
  int tensors() const { return tensors_; }
  const TensorShape& shape(int i) const { return shapes_[i]; }
  int ints() const { return ints_count_; }
  int64_t intAt(int i) const { return ints_[i]; }
  // Bytes of every tensor argument together, and of the largest.
  int64_t inputBytes() const { return input_bytes_; }
  int64_t largestBytes() const { return largest_bytes_; }

 private:
  const std::string* name_ = nullptr;
  TensorShape shapes_[kMaxShapes];
  int tensors_ = 0;
  int64_t ints_[kMaxInts] = {};
  int ints_count_ = 0;
  int64_t input_bytes_ = 0;
  int64_t largest_bytes_ = 0;
};

// A kernel's launch: the wall clock when the host launched it.
struct KernelClock {
  int64_t launch_ns = 0;  // CLOCK_MONOTONIC
  bool read = false;      // false: the chip's speed is not emulated, so no clock was read
};

// Read before a kernel runs. `time_scale` is the chip profile's `slowdown`: 0 when the chip's
// speed is not emulated (nothing is read, every op pays for this call).
KernelClock kernelClockNow(double time_scale);
// After the kernel: put it on the device's timeline for the chip's time for `signature`'s work
// (KernelCosts.h) times `time_scale`.
void chargeKernel(const KernelClock& start, double time_scale, const KernelSignature& signature);
// Put `device_ns` of device time, launched now, on the timeline and pace the host, as a kernel
// of that cost would (the timeline's own checks use it).
void occupyDevice(int64_t device_ns);
// After the host's work for an op (the kernel and what follows it, such as the chip's numerics):
// when the launch queue is full, sleep until half of it has run.
void paceHost();
// Sleep until the device is idle (a synchronisation point).
void settleEmulatedTime();
// Sleep until the device is idle, for a timing sample's bounds: the device's idle time just
// before it (the host still working after its last launch) and just after it (until the next
// launch) count as host lateness, so that a sample less that lateness is the chip's time from
// its first kernel to its last. A plain synchronisation leaves both out, as a real device
// idles there too.
void fenceEmulatedTime();
// How far the device's timeline runs ahead of now, in nanoseconds (for tests and traces).
int64_t emulatedTimeDebtNs();

// What the timeline has seen since the process started (or the last reset).
struct EmulationStats {
  int64_t kernels = 0;         // kernels charged
  int64_t device_busy_ns = 0;  // device time charged (the chip's time times the time scale)
  int64_t host_late_ns = 0;    // time the device sat idle waiting for the host's next launch
  int64_t late_kernels = 0;    // launches that found the device idle waiting for them
};
EmulationStats emulationStats(bool reset);

}  // namespace ditorch
