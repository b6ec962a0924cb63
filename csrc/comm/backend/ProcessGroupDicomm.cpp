#include "comm/backend/ProcessGroupDicomm.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "comm/core/Tags.h"
#include "comm/transport/Log.h"
#include "comm/transport/Trace.h"

namespace dicomm {

namespace {

using c10d::OpType;

ReduceKind reduceKind(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return ReduceKind::kSum;
    case c10d::ReduceOp::AVG: return ReduceKind::kAvg;
    case c10d::ReduceOp::PRODUCT: return ReduceKind::kProduct;
    case c10d::ReduceOp::MIN: return ReduceKind::kMin;
    case c10d::ReduceOp::MAX: return ReduceKind::kMax;
    case c10d::ReduceOp::BAND: return ReduceKind::kBand;
    case c10d::ReduceOp::BOR: return ReduceKind::kBor;
    case c10d::ReduceOp::BXOR: return ReduceKind::kBxor;
    case c10d::ReduceOp::PREMUL_SUM: return ReduceKind::kSum;  // the factor: Reduction below
    default:
      TORCH_CHECK(false, "dicomm: reduce op ", static_cast<int>(op.op_),
                  " is not supported; expected SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR or "
                  "PREMUL_SUM");
  }
}

// A reduce op as the ranks run it: `kind` over the ranks' values, each rank's own input first
// multiplied by its PREMUL_SUM factor (NCCL's ncclRedOpCreatePreMulSum: a rank's factor scales
// only its own contribution, so ranks may pass different ones).
struct Reduction {
  ReduceKind kind = ReduceKind::kSum;
  bool premultiplies = false;
  double factor = 1.0;       // the factor given as a number
  at::Tensor factorTensor;   // or as a one-element tensor (read once the caller's stream reached the call)

  // Multiplies `numel` elements of `dtype` at `data` by this rank's factor (nothing without one).
  void premultiply(void* data, size_t numel, c10::ScalarType dtype) const {
    if (!premultiplies || numel == 0) return;
    at::Tensor v = at::from_blob(data, {static_cast<int64_t>(numel)},
                                 at::TensorOptions().dtype(dtype).device(at::kCPU));
    if (factorTensor.defined()) {
      v.mul_(factorTensor.detach().to(at::kCPU).reshape({}).item());
    } else {
      v.mul_(factor);
    }
  }
  // A premultiplied copy of `host` (for an input the caller keeps); `host` itself without a factor.
  at::Tensor premultiplied(const at::Tensor& host) const {
    if (!premultiplies) return host;
    at::Tensor copy = host.clone();
    premultiply(copy.data_ptr(), copy.numel(), copy.scalar_type());
    return copy;
  }
};

// The op for tensors of `dtype`, refused here (before anything is posted) when undefined for it.
Reduction reductionOf(const c10d::ReduceOp& op, c10::ScalarType dtype) {
  Reduction r;
  r.kind = reduceKind(op);
  if (op.op_ == c10d::ReduceOp::PREMUL_SUM) {
    // The factor multiplies the values in their own dtype, as NCCL's does: defined for floating
    // and complex dtypes only (an integer tensor times 0.5 has no integer result).
    if (!at::isFloatingType(dtype) && !at::isComplexType(dtype)) {
      throw std::invalid_argument(std::string("dicomm: reduce op PREMUL_SUM is not defined for ") +
                                  c10::toString(dtype) +
                                  " tensors (expected a floating-point or complex dtype)");
    }
    auto* supplement = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK(supplement != nullptr, "dicomm: reduce op PREMUL_SUM came without its factor; make it "
                "with ReduceOp.PREMUL_SUM(factor) or torch.distributed._make_nccl_premul_sum(factor)");
    r.premultiplies = true;
    if (supplement->tensor_factor.defined()) {
      const at::Tensor& f = supplement->tensor_factor;
      TORCH_CHECK(f.numel() == 1, "dicomm: a PREMUL_SUM factor tensor must hold one element, got ",
                  f.numel());
      TORCH_CHECK(!at::isComplexType(f.scalar_type()) || at::isComplexType(dtype),
                  "dicomm: a PREMUL_SUM factor of dtype ", f.scalar_type(), " cannot scale ",
                  c10::toString(dtype), " tensors");
      r.factorTensor = f;
    } else {
      r.factor = supplement->double_factor;
    }
  }
  checkReducible(dtype, r.kind);
  return r;
}
std::string shapeOf(const at::Tensor& t) {
  // Built per op (it names the op in errors): plain concatenation, no stream and locale.
  return std::to_string(t.numel()) + " x " + c10::toString(t.scalar_type()) + " on " +
         t.device().str();
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "dicomm ", op, ": expected exactly one tensor per rank, got ",
              tensors.size());
  return tensors[0];
}

void checkSameKind(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "dicomm ", op,
              ": input and output dtypes differ (", a.scalar_type(), " vs ", b.scalar_type(), ")");
}

AllreduceAlgorithm allreduceFromEnv() {
  const char* v = std::getenv("DICOMM_ALLREDUCE");
  const std::string s = v ? v : "";
  if (s.empty() || s == "auto") return AllreduceAlgorithm::kAuto;
  if (s == "ring") return AllreduceAlgorithm::kRing;
  if (s == "hierarchical") return AllreduceAlgorithm::kHierarchical;
  if (s == "shared") return AllreduceAlgorithm::kShared;
  throw std::invalid_argument("dicomm: DICOMM_ALLREDUCE='" + s +
                              "': expected auto, ring, hierarchical or shared");
}

}  // namespace

ProcessGroupDicomm::ProcessGroupDicomm(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                       int size, DicommOptions options)
    : Backend(rank, size), options_(std::move(options)) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "dicomm: rank ", rank,
              " out of range for a group of size ", size);
  TORCH_CHECK(size <= kMaxGroupSize, "dicomm: a group of ", size, " ranks is larger than the ",
              kMaxGroupSize, " its collective message tags can address (a 10-bit ring step)");
  // Read before connecting: a bad value is refused without touching the network, and nothing
  // after the communicator is made throws while its threads may call onFailure below.
  const AllreduceAlgorithm wantedAllreduce = allreduceFromEnv();
  CommunicatorOptions co;
  co.store = store;
  co.rank = rank;
  co.size = size;
  co.timeout = options_.timeout;
  co.transport = options_.transport;
  co.listenHost = options_.listenHost;
  co.onFailure = [this](int, const std::string& cause) {
    // Runs on a transport thread, which close() would join: hand the abort to the watchdog
    // (which finds it on its first look when the pair broke before the watchdog started).
    {
      std::lock_guard<std::mutex> lock(watchMu_);
      if (pendingAbort_.empty()) pendingAbort_ = cause;
    }
    watchCv_.notify_all();
  };
  comm_ = std::make_unique<Communicator>(co);
  allreduceAlgorithm_ = chooseAllreduce(*comm_, wantedAllreduce);
  if (rank == 0) {
    logLine(LogLevel::kInfo,
            std::string("group of ") + std::to_string(size) + " (" + describeHosts(*comm_) +
                "): allreduce " + allreduceAlgorithm() +
                (allreduceAlgorithm_ == AllreduceAlgorithm::kShared
                     ? std::string()
                     : ", payloads of up to " + std::to_string(kDoublingMaxBytes) +
                           " bytes by recursive doubling over each ring") +
                " (hierarchical: a ring per host, then one ring per local index across hosts; "
                "shared: one shared-memory segment on this host); "
                "DICOMM_ALLREDUCE=ring|hierarchical|shared forces one");
  }
  collectiveThread_ = std::thread([this] { collectiveLoop(); });
  watchdog_ = std::thread([this] { watchdogLoop(); });
}

ProcessGroupDicomm::~ProcessGroupDicomm() { shutdown(); }

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupDicomm::getBackendOptions() {
  auto o = c10::make_intrusive<c10d::Backend::Options>("dicomm", options_.timeout);
  o->group_name = options_.groupName;
  return o;
}

std::chrono::milliseconds ProcessGroupDicomm::timeoutOf(std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? options_.timeout : requested;
}

std::string ProcessGroupDicomm::abortCause() const {
  std::lock_guard<std::mutex> lock(abortMu_);
  return abortCause_;
}

c10::intrusive_ptr<WorkDicomm> ProcessGroupDicomm::makeWork(OpType type, std::string description,
                                                            std::vector<at::Tensor> outputs,
                                                            std::chrono::milliseconds timeout) {
  auto work = c10::make_intrusive<WorkDicomm>(this, getRank(), type, std::move(description),
                                              std::move(outputs), timeout);
  if (coalescing_) coalesced_.push_back(work);
  track(work);
  return work;
}

void ProcessGroupDicomm::track(const c10::intrusive_ptr<WorkDicomm>& work) {
  std::lock_guard<std::mutex> lock(watchMu_);
  inflight_.emplace_back(work);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::enqueue(OpType type, std::string description,
                                                           std::vector<at::Tensor> outputs,
                                                           const at::Tensor& issuedOn,
                                                           std::chrono::milliseconds timeout,
                                                           Task task, bool onCaller) {
  auto work = makeWork(type, std::move(description), std::move(outputs), timeout);
  if (aborted_) {
    work->markDone(std::make_exception_ptr(std::runtime_error(abortCause())));
    return work;
  }
  issuedCollectives_.fetch_add(1);
  Queued q{work, std::move(task), timeout, StreamFence(issuedOn, options_.staging)};
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(queueMu_);
    onCaller = onCaller && queue_.empty() && !running_ && !stopping_;
    if (onCaller) {
      running_ = true;  // this thread's turn, in issue order: nothing is queued before it
      seq = collectiveSeq_++;
    } else {
      queue_.push_back(std::move(q));
    }
  }
  if (!onCaller) {
    queueCv_.notify_one();
    return work;
  }
  runCollective(q, seq);
  {
    std::lock_guard<std::mutex> lock(queueMu_);
    running_ = false;
  }
  queueCv_.notify_all();  // the collective thread may wait for the turn
  return work;
}

void ProcessGroupDicomm::collectiveLoop() {
  reduceOnThisThreadOnly();
  while (true) {
    Queued q;
    uint64_t seq;
    {
      std::unique_lock<std::mutex> lock(queueMu_);
      queueCv_.wait(lock, [&] { return !running_ && (stopping_ || !queue_.empty()); });
      if (queue_.empty()) return;
      q = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
      seq = collectiveSeq_++;
    }
    runCollective(q, seq);
    {
      std::lock_guard<std::mutex> lock(queueMu_);
      running_ = false;
    }
    queueCv_.notify_all();
  }
}

void ProcessGroupDicomm::runCollective(Queued& q, uint64_t seq) {
  if (aborted_) {
    q.work->markDone(std::make_exception_ptr(std::runtime_error(abortCause())));
    return;
  }
  CollectiveContext ctx;
  ctx.comm = comm_.get();
  ctx.seq = seq;
  ctx.timeout = q.timeout;
  ctx.deadline = q.work->deadline();
  ctx.op = q.work->description();
  ctx.chunkBytes = options_.chunkBytes;
  ctx.abort = [this](const std::string& cause) { abortWith(cause); };
  if (allreduceAlgorithm_ != AllreduceAlgorithm::kRing && hostSegmentUsable(*comm_)) {
    ctx.hostSegment = [this](CollectiveContext& c) {
      if (!segmentTried_) {
        segmentTried_ = true;
        segment_ = SharedSegment::connect(c, comm_->hosts()[comm_->hostOf(comm_->rank())]);
      }
      return segment_.get();
    };
  }
  comm_->unpark(-1);  // collectives are read by the transports' threads, not by pollers
  try {
    q.fence.wait();
    q.task(ctx);
    q.work->markDone(nullptr);
  } catch (...) {
    q.work->markDone(std::current_exception());
  }
}

void ProcessGroupDicomm::watchdogLoop() {
  std::unique_lock<std::mutex> lock(watchMu_);
  while (!watchStop_) {
    watchCv_.wait_for(lock, std::chrono::milliseconds(100),
                      [&] { return watchStop_ || !pendingAbort_.empty(); });
    if (watchStop_) return;
    std::string cause;
    if (!pendingAbort_.empty()) {
      cause = pendingAbort_;
    } else {
      auto now = std::chrono::steady_clock::now();
      std::vector<c10::weak_intrusive_ptr<WorkDicomm>> live;
      for (auto& w : inflight_) {
        auto work = w.lock();
        if (!work || work->isCompleted()) continue;
        if (cause.empty() && work->deadline() + kTimeoutGrace <= now) {
          cause = "dicomm " + work->description() + " timed out after " +
                  std::to_string(work->timeout().count()) + " ms";
        }
        live.push_back(w);
      }
      inflight_.swap(live);
    }
    if (!cause.empty()) {
      lock.unlock();
      abortWith(cause);
      lock.lock();
      pendingAbort_.clear();
    }
  }
}

void ProcessGroupDicomm::abortWith(const std::string& cause) {
  {
    std::lock_guard<std::mutex> lock(abortMu_);
    if (aborted_) return;
    abortCause_ = cause;
    aborted_ = true;
  }
  // Close first: once it returns no transport thread touches a user buffer any more.
  comm_->abort(cause);
  failInflight();
}

void ProcessGroupDicomm::failInflight() {
  std::vector<c10::weak_intrusive_ptr<WorkDicomm>> all;
  {
    std::lock_guard<std::mutex> lock(watchMu_);
    all = inflight_;
  }
  auto err = std::make_exception_ptr(std::runtime_error(abortCause()));
  for (auto& w : all) {
    if (auto work = w.lock()) work->markDone(err);
  }
}

void ProcessGroupDicomm::abort() { abortWith("abort() was called on this process group"); }

void ProcessGroupDicomm::shutdown() {
  {
    std::lock_guard<std::mutex> lock(queueMu_);
    if (stopping_) return;
    stopping_ = true;  // the collective thread finishes what is queued, then exits
  }
  queueCv_.notify_all();
  if (collectiveThread_.joinable()) collectiveThread_.join();
  {
    std::lock_guard<std::mutex> lock(watchMu_);
    watchStop_ = true;
  }
  watchCv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (!aborted_) {
    comm_->close(std::make_exception_ptr(std::runtime_error(
        "dicomm: the process group was shut down while this op was pending")));
  }
  {
    std::lock_guard<std::mutex> lock(abortMu_);
    if (!aborted_) {
      aborted_ = true;
      abortCause_ = "the process group was shut down";
    }
  }
  failInflight();
}

// ---- coalescing ---------------------------------------------------------------------------

void ProcessGroupDicomm::startCoalescing() {
  TORCH_CHECK(!coalescing_, "dicomm: startCoalescing() called twice without endCoalescing()");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::endCoalescing() {
  TORCH_CHECK(coalescing_, "dicomm: endCoalescing() without startCoalescing()");
  coalescing_ = false;
  auto parts = std::move(coalesced_);
  coalesced_.clear();
  std::vector<at::Tensor> outputs;
  for (auto& p : parts) {
    for (auto& t : p->result()) outputs.push_back(t);
  }
  auto group = makeWork(OpType::COALESCED, "coalesced batch of " + std::to_string(parts.size()) +
                                               " ops", outputs, options_.timeout);
  if (parts.empty()) {
    group->markDone(nullptr);
    return group;
  }
  auto left = std::make_shared<std::atomic<size_t>>(parts.size());
  auto firstError = std::make_shared<std::exception_ptr>();
  auto errMu = std::make_shared<std::mutex>();
  for (auto& p : parts) {
    p->onDone([group, left, firstError, errMu](WorkDicomm& part) {
      if (auto e = part.error()) {
        std::lock_guard<std::mutex> lock(*errMu);
        if (!*firstError) *firstError = e;
      }
      if (left->fetch_sub(1) == 1) group->markDone(*firstError);
    });
  }
  return group;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::asOneBatch(const std::function<void()>& issue) {
  const bool nested = coalescing_;
  if (!nested) startCoalescing();
  try {
    issue();
  } catch (...) {
    if (!nested) endCoalescing();  // what was issued still runs; later ops are not swallowed
    throw;
  }
  return nested ? c10::intrusive_ptr<c10d::Work>() : endCoalescing();
}

// ---- point to point -----------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::pointToPoint(bool isSend,
                                                                std::vector<at::Tensor>& tensors,
                                                                int peer, int tag) {
  trace::mark(isSend ? trace::kSendCall : trace::kRecvCall);
  const at::Tensor& t = single(tensors, isSend ? "send" : "recv");
  std::string desc = std::string(isSend ? "send to " : "recv from ") +
                     (peer < 0 ? std::string("any rank") : "rank " + std::to_string(peer)) +
                     " (tag " + std::to_string(tag) + ", " + shapeOf(t) + ")";
  auto work = makeWork(isSend ? OpType::SEND : (peer < 0 ? OpType::RECVANYSOURCE : OpType::RECV),
                       desc, isSend ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{t},
                       options_.timeout);
  if (aborted_) {
    work->markDone(std::make_exception_ptr(std::runtime_error(abortCause())));
    return work;
  }
  auto view = std::make_shared<HostView>(t, options_.staging, /*load=*/isSend);
  const int32_t dtype = static_cast<int32_t>(view->dtype());
  if (peer >= 0 && !coalescing_) {
    work->pollPeer(comm_.get(), peer);
  } else {
    comm_->unpark(peer);  // nobody will poll for this op: the transports' threads read
  }
  if (isSend) {
    trace::mark(trace::kSendPosted);
    comm_->isend(peer, p2pTag(tag), view->data(), view->nbytes(), dtype,
                 [work, view](Completion& c) { work->markDone(c.error(), c.source()); });
  } else {
    comm_->irecv(peer, p2pTag(tag), view->data(), view->nbytes(), dtype,
                 [work, view](Completion& c) {
                   std::exception_ptr error = c.error();
                   if (!error) {
                     try {
                       view->store();
                     } catch (...) {
                       error = std::current_exception();
                     }
                   }
                   trace::mark(trace::kRecvLanded);
                   work->markDone(error, c.source());
                 });
    trace::mark(trace::kRecvPosted);
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::send(std::vector<at::Tensor>& tensors,
                                                        int dstRank, int tag) {
  return pointToPoint(true, tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::recv(std::vector<at::Tensor>& tensors,
                                                        int srcRank, int tag) {
  return pointToPoint(false, tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                 int tag) {
  return pointToPoint(false, tensors, -1, tag);
}

// ---- collectives --------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  at::Tensor t = single(tensors, "allreduce");
  Reduction op = reductionOf(opts.reduceOp, t.scalar_type());
  auto policy = options_.staging;
  return enqueue(OpType::ALLREDUCE, "allreduce (" + shapeOf(t) + ")", {t}, t,
                 timeoutOf(opts.timeout), [t, op, policy, algo = allreduceAlgorithm_](CollectiveContext& ctx) {
                   HostView v(t, policy, true);
                   op.premultiply(v.data(), v.numel(), v.dtype());  // t is overwritten anyway
                   dicomm::allreduce(ctx, v.data(), v.numel(), v.dtype(), op.kind, algo);
                   v.store();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "dicomm allreduce_coalesced: expected at least one tensor");
  std::vector<Reduction> checked;
  for (auto& t : tensors) checked.push_back(reductionOf(opts.reduceOp, t.scalar_type()));
  const Reduction op = checked[0];  // the same op and factor; each dtype was checked above
  auto policy = options_.staging;
  std::vector<at::Tensor> ts = tensors;
  return enqueue(OpType::ALLREDUCE_COALESCED,
                 "allreduce_coalesced (" + std::to_string(ts.size()) + " tensors)", ts, ts[0],
                 timeoutOf(opts.timeout), [ts, op, policy, algo = allreduceAlgorithm_](CollectiveContext& ctx) {
                   // One flat buffer per dtype: one ring instead of one per tensor.
                   std::map<c10::ScalarType, std::vector<at::Tensor>> byType;
                   for (auto& t : ts) byType[t.scalar_type()].push_back(t);
                   for (auto& [dtype, group] : byType) {
                     std::vector<at::Tensor> flat;
                     for (auto& t : group) flat.push_back(t.detach().to(at::kCPU).reshape({-1}));
                     at::Tensor buf = at::cat(flat);
                     op.premultiply(buf.data_ptr(), buf.numel(), dtype);
                     dicomm::allreduce(ctx, buf.data_ptr(), buf.numel(), dtype, op.kind, algo);
                     ctx.seq += 1u << 20;  // distinct tags for the next dtype's ring
                     int64_t off = 0;
                     for (auto& t : group) {
                       t.copy_(buf.narrow(0, off, t.numel()).view(t.sizes()));
                       off += t.numel();
                     }
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  at::Tensor t = single(tensors, "broadcast");
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < getSize(), "dicomm broadcast: root ", root,
              " out of range [0, ", getSize(), ")");
  auto policy = options_.staging;
  return enqueue(OpType::BROADCAST, "broadcast from rank " + std::to_string(root) + " (" + shapeOf(t) + ")",
                 {t}, t, timeoutOf(opts.timeout), [t, root, policy](CollectiveContext& ctx) {
                   HostView v(t, policy, ctx.comm->rank() == root);
                   dicomm::broadcast(ctx, v.data(), v.numel(), v.dtype(), root);
                   if (ctx.comm->rank() != root) v.store();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  at::Tensor t = single(tensors, "reduce");
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < getSize(), "dicomm reduce: root ", root, " out of range [0, ",
              getSize(), ")");
  Reduction op = reductionOf(opts.reduceOp, t.scalar_type());
  auto policy = options_.staging;
  return enqueue(OpType::REDUCE, "reduce to rank " + std::to_string(root) + " (" + shapeOf(t) + ")",
                 {t}, t, timeoutOf(opts.timeout), [t, root, op, policy](CollectiveContext& ctx) {
                   HostView v(t, policy, true);
                   // A non-root rank's tensor stays as it was: premultiply a copy.
                   at::Tensor work = op.premultiplied(v.host());
                   dicomm::reduce(ctx, work.data_ptr(), v.numel(), v.dtype(), op.kind, root);
                   if (ctx.comm->rank() == root) {
                     if (!work.is_same(v.host())) v.host().copy_(work);
                     v.store();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  at::Tensor in = single(inputs, "allgather");
  TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
              "dicomm allgather: expected one list of ", getSize(), " output tensors");
  std::vector<at::Tensor> outs = outputs[0];
  for (auto& o : outs) checkSameKind(in, o, "allgather");
  TORCH_CHECK(outs[getRank()].numel() == in.numel(), "dicomm allgather: output slot ", getRank(),
              " has ", outs[getRank()].numel(), " elements but the input has ", in.numel());
  auto policy = options_.staging;
  return enqueue(OpType::ALLGATHER, "allgather (" + shapeOf(in) + ")", outs, in,
                 timeoutOf(opts.timeout), [in, outs, policy](CollectiveContext& ctx) {
                   const int n = ctx.comm->size();
                   std::vector<Segment> segs(n);
                   size_t total = 0;
                   for (int p = 0; p < n; ++p) {
                     segs[p] = Segment{total, static_cast<size_t>(outs[p].numel())};
                     total += segs[p].count;
                   }
                   at::Tensor buf = at::empty({static_cast<int64_t>(total)},
                                              at::TensorOptions().dtype(in.scalar_type()));
                   HostView v(in, policy, true);
                   const size_t es = buf.element_size();
                   // An empty tensor's buffer may be null, which memcpy may not be given even for 0 bytes.
                   if (v.nbytes()) {
                     std::memcpy(static_cast<char*>(buf.data_ptr()) + segs[ctx.comm->rank()].offset * es,
                                 v.data(), v.nbytes());
                   }
                   dicomm::allgather(ctx, buf.data_ptr(), segs, in.scalar_type());
                   for (int p = 0; p < n; ++p) {
                     outs[p].copy_(buf.narrow(0, segs[p].offset, segs[p].count).view(outs[p].sizes()));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  at::Tensor out = output, in = input;
  checkSameKind(in, out, "all_gather_into_tensor");
  TORCH_CHECK(out.numel() == in.numel() * getSize(), "dicomm all_gather_into_tensor: output has ",
              out.numel(), " elements, expected ", getSize(), " x ", in.numel());
  auto policy = options_.staging;
  return enqueue(OpType::_ALLGATHER_BASE, "all_gather_into_tensor (" + shapeOf(in) + ")", {out}, in,
                 timeoutOf(opts.timeout), [in, out, policy](CollectiveContext& ctx) {
                   HostView o(out, policy, false);
                   HostView i(in, policy, true);
                   const size_t n = i.numel(), es = c10::elementSize(i.dtype());
                   // An empty tensor's buffer may be null, which memcpy may not be given even for 0 bytes.
                   if (n) std::memcpy(static_cast<char*>(o.data()) + ctx.comm->rank() * n * es, i.data(), n * es);
                   std::vector<Segment> segs(ctx.comm->size());
                   for (int p = 0; p < ctx.comm->size(); ++p) segs[p] = Segment{p * n, n};
                   dicomm::allgather(ctx, o.data(), segs, i.dtype());
                   o.store();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  // torch's contract (and gloo's): one output list per rank, each holding one tensor per input.
  TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "dicomm all_gather_coalesced: expected ",
              getSize(), " output lists (one per rank), got ", outputs.size());
  for (size_t r = 0; r < outputs.size(); ++r) {
    TORCH_CHECK(outputs[r].size() == inputs.size(), "dicomm all_gather_coalesced: output list ", r,
                " holds ", outputs[r].size(), " tensors; expected one per input (", inputs.size(), ")");
  }
  return asOneBatch([&] {
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::vector<std::vector<at::Tensor>> o(1);
      for (auto& perRank : outputs) o[0].push_back(perRank[i]);
      std::vector<at::Tensor> in{inputs[i]};
      allgather(o, in, opts);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "dicomm all_gather_into_tensor_coalesced: ",
              outputs.size(), " outputs for ", inputs.size(), " inputs");
  return asOneBatch([&] {
    for (size_t i = 0; i < inputs.size(); ++i) _allgather_base(outputs[i], inputs[i], opts);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  at::Tensor in = single(inputs, "gather");
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < getSize(), "dicomm gather: root ", root, " out of range");
  std::vector<at::Tensor> outs;
  if (getRank() == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                "dicomm gather: the root expects one list of ", getSize(), " output tensors");
    outs = outputs[0];
    for (auto& o : outs) {
      checkSameKind(in, o, "gather");
      TORCH_CHECK(o.numel() == in.numel(), "dicomm gather: output tensors must have ", in.numel(),
                  " elements like the input, got ", o.numel());
    }
  } else {
    TORCH_CHECK(outputs.empty() || outputs[0].empty(),
                "dicomm gather: only the root (rank ", root, ") takes output tensors");
  }
  auto policy = options_.staging;
  return enqueue(OpType::GATHER, "gather to rank " + std::to_string(root) + " (" + shapeOf(in) + ")",
                 outs, in, timeoutOf(opts.timeout), [in, outs, root, policy](CollectiveContext& ctx) {
                   HostView i(in, policy, true);
                   at::Tensor buf;
                   if (ctx.comm->rank() == root) {
                     buf = at::empty({static_cast<int64_t>(i.numel()) * ctx.comm->size()},
                                     at::TensorOptions().dtype(i.dtype()));
                   }
                   dicomm::gather(ctx, i.data(), i.numel(), i.dtype(), buf.defined() ? buf.data_ptr() : nullptr,
                          root);
                   for (size_t p = 0; p < outs.size(); ++p) {
                     outs[p].copy_(buf.narrow(0, p * i.numel(), i.numel()).view(outs[p].sizes()));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  at::Tensor out = single(outputs, "scatter");
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < getSize(), "dicomm scatter: root ", root, " out of range");
  std::vector<at::Tensor> ins;
  if (getRank() == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                "dicomm scatter: the root expects one list of ", getSize(), " input tensors");
    ins = inputs[0];
    for (auto& i : ins) {
      checkSameKind(i, out, "scatter");
      TORCH_CHECK(i.numel() == out.numel(), "dicomm scatter: input tensors must have ",
                  out.numel(), " elements like the output, got ", i.numel());
    }
  }
  auto policy = options_.staging;
  return enqueue(OpType::SCATTER, "scatter from rank " + std::to_string(root) + " (" + shapeOf(out) + ")",
                 {out}, out, timeoutOf(opts.timeout), [ins, out, root, policy](CollectiveContext& ctx) {
                   HostView o(out, policy, false);
                   at::Tensor buf;
                   if (!ins.empty()) {
                     std::vector<at::Tensor> flat;
                     for (auto& t : ins) flat.push_back(t.detach().to(at::kCPU).reshape({-1}));
                     buf = at::cat(flat);
                   }
                   dicomm::scatter(ctx, buf.defined() ? buf.data_ptr() : nullptr, o.data(), o.numel(),
                           o.dtype(), root);
                   o.store();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  at::Tensor out = single(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
              "dicomm reduce_scatter: expected one list of ", getSize(), " input tensors");
  std::vector<at::Tensor> ins = inputs[0];
  for (auto& i : ins) {
    checkSameKind(i, out, "reduce_scatter");
    TORCH_CHECK(i.numel() == out.numel(), "dicomm reduce_scatter: input tensors must have ",
                out.numel(), " elements like the output, got ", i.numel());
  }
  Reduction op = reductionOf(opts.reduceOp, out.scalar_type());
  auto policy = options_.staging;
  return enqueue(OpType::REDUCE_SCATTER, "reduce_scatter (" + shapeOf(out) + ")", {out}, out,
                 timeoutOf(opts.timeout), [ins, out, op, policy](CollectiveContext& ctx) {
                   std::vector<at::Tensor> flat;
                   for (auto& t : ins) flat.push_back(t.detach().to(at::kCPU).reshape({-1}));
                   at::Tensor buf = at::cat(flat);
                   op.premultiply(buf.data_ptr(), buf.numel(), buf.scalar_type());
                   const int r = ctx.comm->rank(), n = ctx.comm->size();
                   auto segs = splitEven(buf.numel(), n);
                   at::Tensor mine = buf.narrow(0, segs[r].offset, segs[r].count);
                   dicomm::reduceScatter(ctx, buf.data_ptr(), segs, mine.data_ptr(), buf.scalar_type(), op.kind);
                   out.copy_(mine.view(out.sizes()));
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  at::Tensor out = output, in = input;
  checkSameKind(in, out, "reduce_scatter_tensor");
  TORCH_CHECK(in.numel() == out.numel() * getSize(), "dicomm reduce_scatter_tensor: input has ",
              in.numel(), " elements, expected ", getSize(), " x ", out.numel());
  Reduction op = reductionOf(opts.reduceOp, out.scalar_type());
  auto policy = options_.staging;
  return enqueue(OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor (" + shapeOf(out) + ")",
                 {out}, in, timeoutOf(opts.timeout), [in, out, op, policy](CollectiveContext& ctx) {
                   HostView i(in, policy, true);  // only read: the caller's input stays intact
                   HostView o(out, policy, false);
                   const int n = ctx.comm->size();
                   std::vector<Segment> segs(n);
                   const size_t m = out.numel();
                   for (int p = 0; p < n; ++p) segs[p] = Segment{p * m, m};
                   at::Tensor input = op.premultiplied(i.host());
                   dicomm::reduceScatter(ctx, input.data_ptr(), segs, o.data(), i.dtype(), op.kind);
                   o.store();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "dicomm reduce_scatter_tensor_coalesced: ",
              outputs.size(), " outputs for ", inputs.size(), " inputs");
  return asOneBatch([&] {
    for (size_t i = 0; i < inputs.size(); ++i) _reduce_scatter_base(outputs[i], inputs[i], opts);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
    std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts) {
  at::Tensor out = output, in = input;
  checkSameKind(in, out, "all_to_all_single");
  const int n = getSize();
  auto counts = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* which) {
    std::vector<size_t> c(n);
    const int64_t rows = t.dim() ? t.size(0) : 1;
    const int64_t rowElems = rows ? t.numel() / rows : 0;
    if (splits.empty()) {
      TORCH_CHECK(rows % n == 0, "dicomm all_to_all_single: ", which, " dim 0 (", rows,
                  ") is not divisible by the group size ", n);
      for (auto& x : c) x = static_cast<size_t>(rows / n * rowElems);
    } else {
      TORCH_CHECK(static_cast<int>(splits.size()) == n, "dicomm all_to_all_single: ", which,
                  " splits has ", splits.size(), " entries, expected ", n);
      int64_t sum = 0;
      for (int p = 0; p < n; ++p) {
        c[p] = static_cast<size_t>(splits[p] * rowElems);
        sum += splits[p];
      }
      TORCH_CHECK(sum == rows, "dicomm all_to_all_single: ", which, " splits sum to ", sum,
                  " but dim 0 is ", rows);
    }
    return c;
  };
  auto sendCounts = counts(in, inputSplits, "input");
  auto recvCounts = counts(out, outputSplits, "output");
  auto offsets = [](const std::vector<size_t>& c) {
    std::vector<size_t> o(c.size());
    for (size_t i = 1; i < c.size(); ++i) o[i] = o[i - 1] + c[i - 1];
    return o;
  };
  auto sendOffsets = offsets(sendCounts), recvOffsets = offsets(recvCounts);
  auto policy = options_.staging;
  return enqueue(OpType::ALLTOALL_BASE, "all_to_all_single (" + shapeOf(in) + ")", {out}, in,
                 timeoutOf(opts.timeout),
                 [=](CollectiveContext& ctx) {
                   HostView i(in, policy, true);
                   HostView o(out, policy, false);
                   dicomm::alltoall(ctx, i.data(), sendOffsets, sendCounts, o.data(), recvOffsets,
                            recvCounts, i.dtype());
                   o.store();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions& opts) {
  const int n = getSize();
  TORCH_CHECK(static_cast<int>(outputs.size()) == n && static_cast<int>(inputs.size()) == n,
              "dicomm all_to_all: expected ", n, " input and ", n, " output tensors, got ",
              inputs.size(), " and ", outputs.size());
  std::vector<at::Tensor> outs = outputs, ins = inputs;
  for (int p = 0; p < n; ++p) checkSameKind(ins[p], outs[p], "all_to_all");
  return enqueue(OpType::ALLTOALL, "all_to_all (" + std::to_string(n) + " tensors)", outs, outs[0],
                 timeoutOf(opts.timeout), [outs, ins, n](CollectiveContext& ctx) {
                   std::vector<size_t> sc(n), rc(n), so(n), ro(n);
                   std::vector<at::Tensor> flatIn;
                   for (int p = 0; p < n; ++p) {
                     sc[p] = ins[p].numel();
                     rc[p] = outs[p].numel();
                     if (p) {
                       so[p] = so[p - 1] + sc[p - 1];
                       ro[p] = ro[p - 1] + rc[p - 1];
                     }
                     flatIn.push_back(ins[p].detach().to(at::kCPU).reshape({-1}));
                   }
                   at::Tensor in = at::cat(flatIn);
                   at::Tensor out = at::empty({static_cast<int64_t>(ro[n - 1] + rc[n - 1])},
                                              in.options());
                   dicomm::alltoall(ctx, in.data_ptr(), so, sc, out.data_ptr(), ro, rc, in.scalar_type());
                   for (int p = 0; p < n; ++p) {
                     outs[p].copy_(out.narrow(0, ro[p], rc[p]).view(outs[p].sizes()));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDicomm::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(OpType::BARRIER, "barrier", {}, at::Tensor(), timeoutOf(opts.timeout),
                 [](CollectiveContext& ctx) { dicomm::barrier(ctx); }, /*onCaller=*/true);
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupDicomm::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  auto it = std::find(ranks.begin(), ranks.end(), getRank());
  if (it == ranks.end()) return nullptr;  // not a member of the new group
  DicommOptions o = options_;
  if (opts) {
    o.timeout = opts->timeout;
    o.groupName = opts->group_name;
  }
  return c10::make_intrusive<ProcessGroupDicomm>(store, static_cast<int>(it - ranks.begin()),
                                                 static_cast<int>(ranks.size()), o);
}

}  // namespace dicomm
