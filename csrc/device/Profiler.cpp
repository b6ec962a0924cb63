// torch.profiler on dipu: the device's kernels on the device's timeline, linked to the CPU ops
// that launched them, through PyTorch's two extension points for an out-of-tree device.
//
// - Kineto (`torch.profiler.profile(activities=[CPU, PrivateUse1])`, PyTorch's default path): a
//   child activity profiler registered with libkineto. While a trace runs, a RecordFunction
//   callback marks each leaf op with a dipu tensor among its inputs (the op whose kernel the
//   operator shim ran; its parents, such as aten::linear or an autograd node, only dispatch) and
//   takes the device's clock before and after it; Kineto hands each op's correlation id to the
//   session as it pushes it. The session then logs one kernel activity per such op, linked to
//   its CPU op, so it shows in the Chrome trace on the device's row and `key_averages()` counts it
//   in `device_time_total`.
// - The legacy fallback (`torch.autograd.profiler.profile(use_device="dipu", use_kineto=False)`
//   and ProfilerState.KINETO_PRIVATEUSE1_FALLBACK): PyTorch's PrivateUse1 ProfilerStubs, an event
//   recorded at each op's start and end, the elapsed time between them.
//
// The device's clock: on the emu vendor a chip slower than the host runs its kernels on the
// emulated timeline (SpeedEmulation.h), so a point in the device's work is when the device will
// be idle if the host launched nothing more: now plus the time the device still owes. A kernel
// then spans its emulated time, not the host's. On the host chip that debt is zero and a kernel
// runs on the calling thread, so its span is its host time. A vendor with a stream runtime (cuda)
// runs kernels asynchronously: there the op's stream is synchronised before and after it, which
// serialises the run while it is traced (the device's own profiler, CUPTI with
// ProfilerActivity.CUDA, sees the vendor's kernels without that cost).
// RecordFunction::inputs() asserts in builds without NDEBUG that the op recorded its inputs, which
// ops recorded from Python (aten::to) do not: they have none, which is all this file needs to know.
#ifndef NDEBUG
#define NDEBUG
#endif

#include "device/Guard.h"
#include "device/SpeedEmulation.h"
#include "device/vendor/Vendor.h"

// Kineto's activity header formats metadata with fmt, which libtorch links in without exporting it:
// compiled into this file instead.
#define FMT_HEADER_ONLY
#include <fmt/format.h>

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <kineto/libkineto.h>
#include <kineto/output_base.h>
#include <torch/csrc/profiler/stubs/base.h>

#include <atomic>
#include <cstring>
#include <chrono>
#include <ctime>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace ditorch {
namespace {

int64_t monotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int64_t unixNs() {
  using namespace std::chrono;
  return duration_cast<nanoseconds>(system_clock::now().time_since_epoch()).count();
}

// When work the host launched up to now will be done on the device (CLOCK_MONOTONIC). On an
// asynchronous vendor the device is drained first, so the point is exact there too.
int64_t deviceClockNs(int device) {
  if (vendor().streamRuntime() != nullptr) vendor().synchronize(device);
  return monotonicNs() + emulatedTimeDebtNs();
}

// The dipu device an op works on: its first dipu tensor input (tensor lists included), or -1.
int dipuDeviceOf(const at::RecordFunction& fn) {
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined() && t.device().type() == c10::DeviceType::PrivateUse1) return t.device().index();
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor() && e.toTensor().defined() && e.toTensor().device().type() == c10::DeviceType::PrivateUse1)
          return e.toTensor().device().index();
    }
  }
  return -1;
}

// The record_function name prefix of a kernel that runs outside the dispatcher.
constexpr char kGeneratedKernelPrefix[] = "dipu kernel ";

// One dipu kernel as the trace shows it.
struct KernelSpan {
  std::string name;
  uint64_t correlation;
  int device;
  int64_t stream;
  int64_t start_ns;  // CLOCK_MONOTONIC on the device's clock
  int64_t end_ns;
};

// An op in progress on this thread, as the RecordFunction callback saw it start.
struct OpFrame : at::ObserverContext {
  uint64_t correlation = 0;
  bool awaiting_correlation = true;  // Kineto pushes the op's id right after our start callback
  bool leaf = true;
  int device = -1;
  int64_t start_ns = 0;
};

thread_local std::vector<OpFrame*> t_frames;

// What the running trace has recorded. One trace at a time per process, as Kineto runs one.
class KernelRecorder {
 public:
  static KernelRecorder& get() {
    static KernelRecorder r;
    return r;
  }

  void start() {
    std::lock_guard<std::mutex> lock(mu_);
    spans_.clear();
    if (handle_ != 0) return;
    // Global, not thread-local: autograd's device threads run the backward's kernels. Global
    // callbacks run before thread-local ones (the profiler's), at an op's start and at its end, so
    // our frame is on top when Kineto pushes the op's correlation id.
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&KernelRecorder::onStart, &KernelRecorder::onEnd).needsInputs(true));
  }

  std::vector<KernelSpan> stop() {
    std::lock_guard<std::mutex> lock(mu_);
    if (handle_ != 0) at::removeCallback(handle_);
    handle_ = 0;
    return std::move(spans_);
  }

  void add(KernelSpan span) {
    std::lock_guard<std::mutex> lock(mu_);
    if (spans_.size() < kMaxSpans) spans_.push_back(std::move(span));
  }

 private:
  // A trace of a few steps holds tens of thousands of ops; this bounds a trace left running.
  static constexpr size_t kMaxSpans = size_t(1) << 22;

  static std::unique_ptr<at::ObserverContext> onStart(const at::RecordFunction& fn) {
    auto frame = std::make_unique<OpFrame>();
    frame->device = dipuDeviceOf(fn);
    // A kernel that runs outside the dispatcher (one Inductor generated) is announced by a
    // record_function of that name around it (ditorch_ext/inductor.py): on the current device.
    if (frame->device < 0 && fn.scope() == at::RecordScope::USER_SCOPE &&
        std::strncmp(fn.name(), kGeneratedKernelPrefix, sizeof(kGeneratedKernelPrefix) - 1) == 0)
      frame->device = currentDevice();
    if (frame->device >= 0) {
      // A dipu op inside another makes that one a dispatcher of kernels, not a kernel. (The ops a
      // vendor kernel calls inside itself are on the kernel device's tensors: they leave it a leaf.)
      for (auto it = t_frames.rbegin(); it != t_frames.rend(); ++it) {
        if ((*it)->device >= 0) {
          (*it)->leaf = false;
          break;
        }
      }
      frame->start_ns = deviceClockNs(frame->device);
    }
    t_frames.push_back(frame.get());
    return frame;
  }

  static void onEnd(const at::RecordFunction& fn, at::ObserverContext* ctx) {
    auto* frame = static_cast<OpFrame*>(ctx);
    if (frame == nullptr) return;
    // An op ending on another thread than it started (async ops) was never this thread's frame.
    for (auto it = t_frames.rbegin(); it != t_frames.rend(); ++it) {
      if (*it == frame) {
        t_frames.erase(std::next(it).base());
        break;
      }
    }
    if (frame->device < 0 || !frame->leaf || frame->correlation == 0) return;
    const int64_t end_ns = deviceClockNs(frame->device);
    const c10::Stream stream = vendor().streamRuntime() != nullptr
                                   ? vendor().streamRuntime()->getStream(kernelDevice(frame->device))
                                   : c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::PrivateUse1, 0));
    // Named apart from the CPU op, as a device's kernels are, so key_averages() keeps them apart.
    const bool generated = fn.scope() == at::RecordScope::USER_SCOPE;
    get().add(KernelSpan{generated ? std::string(fn.name() + sizeof(kGeneratedKernelPrefix) - 1)
                                   : std::string(fn.name()) + " [dipu]",
                         frame->correlation, frame->device, stream.id(), frame->start_ns,
                         std::max(end_ns, frame->start_ns)});
  }

  std::mutex mu_;
  at::CallbackHandle handle_ = 0;
  std::vector<KernelSpan> spans_;
};

void noteCorrelation(uint64_t id) {
  if (!t_frames.empty() && t_frames.back()->awaiting_correlation) {
    OpFrame* frame = t_frames.back();
    frame->correlation = id;
    frame->awaiting_correlation = false;
    // The profiler stamps the op's start just before it pushes the id: the kernel starts after.
    if (frame->device >= 0) frame->start_ns = deviceClockNs(frame->device);
  }
}

class DipuSession final : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    KernelRecorder::get().start();
    status_ = libkineto::TraceStatus::RECORDING;
  }
  void stop() override {
    spans_ = KernelRecorder::get().stop();
    status_ = libkineto::TraceStatus::PROCESSING;
  }
  std::vector<std::string> errors() override { return {}; }

  void pushCorrelationId(uint64_t id) override { noteCorrelation(id); }
  void pushUserCorrelationId(uint64_t id) override { noteCorrelation(id); }

  void processTrace(libkineto::ActivityLogger& logger) override { processTrace(logger, nullptr, 0, 0); }

  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked, int64_t,
                    int64_t) override {
    buffer_ = std::make_unique<libkineto::CpuTraceBuffer>();
    buffer_->span.name = "dipu";
    // The spans' clock is CLOCK_MONOTONIC; Kineto's is the Unix epoch in nanoseconds.
    const int64_t to_unix = unixNs() - monotonicNs();
    for (const KernelSpan& s : spans_) {
      auto act = std::make_unique<libkineto::GenericTraceActivity>(
          buffer_->span, libkineto::ActivityType::CONCURRENT_KERNEL, s.name);
      act->startTime = s.start_ns + to_unix;
      act->endTime = s.end_ns + to_unix;
      act->id = int32_t(s.correlation);
      act->device = s.device;
      act->resource = int32_t(s.stream);
      act->linked = linked ? linked(int32_t(s.correlation)) : nullptr;
      act->flow.id = uint32_t(s.correlation);
      act->flow.type = libkineto::kLinkAsyncCpuGpu;
      act->flow.start = 0;
      act->addMetadata("device", s.device);
      act->addMetadata("stream", s.stream);
      act->addMetadata("correlation", s.correlation);
      devices_.insert(s.device);
      streams_.insert({s.device, s.stream});
      logger.handleGenericActivity(*act);
      buffer_->activities.push_back(std::move(act));
    }
    status_ = libkineto::TraceStatus::READY;
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    if (devices_.empty()) return nullptr;
    const int device = *devices_.begin();
    return std::make_unique<libkineto::DeviceInfo>(libkineto::DeviceInfo{
        device, device, "dipu " + std::to_string(device), std::string(vendor().name()) + " " + std::to_string(device)});
  }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    std::vector<libkineto::ResourceInfo> infos;
    for (const auto& [device, stream] : streams_)
      infos.push_back(libkineto::ResourceInfo{stream, stream, device, "dipu stream " + std::to_string(stream)});
    return infos;
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return std::move(buffer_); }

 private:
  std::vector<KernelSpan> spans_;
  std::set<int> devices_;
  std::set<std::pair<int, int64_t>> streams_;
  std::unique_ptr<libkineto::CpuTraceBuffer> buffer_;
};

class DipuActivityProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<libkineto::ActivityType>& availableActivities() const override { return activities_; }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config&) override {
    // Only when the trace asks for device kernels (a CPU-only trace leaves dipu ops alone).
    if (!types.count(libkineto::ActivityType::CONCURRENT_KERNEL)) return nullptr;
    return std::make_unique<DipuSession>();
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t, int64_t,
                                                                 const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_ = "dipu";
  std::set<libkineto::ActivityType> activities_{libkineto::ActivityType::CONCURRENT_KERNEL};
};

// The legacy path's events: a point on the device's clock.
struct StubEvent {
  int64_t device_ns;
};

struct DipuProfilerStubs final : public torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    const int d = currentDevice();
    if (device) *device = static_cast<c10::DeviceIndex>(d);
    *event = std::make_shared<StubEvent>(StubEvent{deviceClockNs(d)});
    if (cpu_ns) *cpu_ns = unixNs();
  }
  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* a,
                const torch::profiler::impl::ProfilerVoidEventStub* b) const override {
    TORCH_CHECK(a && b && *a && *b, "dipu profiler: elapsed time asked of an event that was never recorded");
    const auto* start = static_cast<const StubEvent*>(a->get());
    const auto* end = static_cast<const StubEvent*>(b->get());
    return float(double(end->device_ns - start->device_ns) / 1000.0);  // microseconds, as CUDA's stubs
  }
  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }
  void onEachDevice(std::function<void(int)> op) const override {
    const int previous = currentDevice();
    for (int d = 0; d < deviceCount(); ++d) {
      setCurrentDevice(d);
      op(d);
    }
    setCurrentDevice(previous);
  }
  void synchronize() const override {
    for (int d = 0; d < deviceCount(); ++d) vendor().synchronize(d);
  }
};

}  // namespace

void registerProfiler() {
  static bool done = false;
  if (done) return;
  done = true;
  static DipuProfilerStubs stubs;
  torch::profiler::impl::registerPrivateUse1Methods(&stubs);
  libkineto::api().registerProfilerFactory([] { return std::make_unique<DipuActivityProfiler>(); });
}

// Registered as the module loads, as a device's own profiler plugin is.
namespace {
const bool kRegistered = (registerProfiler(), true);
}

}  // namespace ditorch
