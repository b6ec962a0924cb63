// The `dicomm` c10d backend.
//
// Point-to-point ops go straight to the communicator from the calling thread. Collectives run in
// issue order on one collective thread per group, composed from point-to-point transfers
// (csrc/comm/core/Collectives.h); a barrier that finds nothing queued or running is run by the
// calling thread itself (it waits for it anyway, and waking the collective thread, asleep on
// an idle VM's halted vCPU, took tens of microseconds on each rank, which the ranks then left
// the barrier apart by). A watchdog thread enforces every op's deadline and turns a
// broken pair into an abort: the communicator closes and every pending op fails with an error
// that names the op, the peer and the cause. After an abort, new ops fail immediately.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "comm/backend/Staging.h"
#include "comm/backend/WorkDicomm.hpp"
#include "comm/core/Collectives.h"
#include "comm/core/Communicator.h"
#include "comm/core/SharedSegment.h"

namespace dicomm {

struct DicommOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  std::string transport = "auto";
  std::string listenHost;  // DICOMM_LISTEN_HOST; "" = the interface routing to the store
  size_t chunkBytes = 4 << 20;
  StagingPolicy staging;
  std::string groupName;
};

class ProcessGroupDicomm : public c10d::Backend {
 public:
  ProcessGroupDicomm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     DicommOptions options);
  ~ProcessGroupDicomm() override;

  const std::string getBackendName() const override { return "dicomm"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  bool supportsCoalescing() const override { return true; }
  bool supportsSplitting() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override { options_.timeout = timeout; }
  // Collectives are numbered from 0 in issue order on every rank (their tags carry the number),
  // so there is nothing to agree on here.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return issuedCollectives_.load(); }

  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;

  void abort() override;
  void shutdown() override;

  // Abort with `cause` (idempotent; safe from any thread except a transport thread).
  void abortWith(const std::string& cause);
  bool aborted() const { return aborted_.load(); }
  // How this group's allreduces run (DICOMM_ALLREDUCE and the group's hosts).
  std::string allreduceAlgorithm() const {
    switch (allreduceAlgorithm_) {
      case AllreduceAlgorithm::kHierarchical: return "hierarchical";
      case AllreduceAlgorithm::kAuto: return "hierarchical below 4 MiB, ring above";
      case AllreduceAlgorithm::kShared: return "shared";
      default: return "ring";
    }
  }
  // The ranks this rank reduces with through its host's shared segment: empty before the
  // first allreduce that connects it (read after that allreduce completed), or when none.
  std::vector<int> hostSegmentMembers() const { return segment_ ? segment_->members() : std::vector<int>{}; }
  std::string abortCause() const;
  std::string transportOf(int peer) const { return comm_->transportOf(peer); }
  int connectionsOf(int peer) const { return comm_->connectionsOf(peer); }
  std::string congestionOf(int peer) const { return comm_->congestionOf(peer); }
  std::string linkOf(int peer) const { return comm_->linkOf(peer); }
  const DicommOptions& options() const { return options_; }

 private:
  using Task = std::function<void(CollectiveContext&)>;
  struct Queued {
    c10::intrusive_ptr<WorkDicomm> work;
    Task task;
    std::chrono::milliseconds timeout;
    StreamFence fence;  // the caller's stream at the call: the task's copies wait for it
  };

  std::chrono::milliseconds timeoutOf(std::chrono::milliseconds requested) const;
  // The ops `issue` starts as one coalesced batch (one Work), or as part of the caller's batch
  // when one is open (then no Work: the caller's endCoalescing() returns it).
  c10::intrusive_ptr<c10d::Work> asOneBatch(const std::function<void()>& issue);
  c10::intrusive_ptr<WorkDicomm> makeWork(c10d::OpType type, std::string description,
                                          std::vector<at::Tensor> outputs,
                                          std::chrono::milliseconds timeout);
  // Queue a collective; `task` runs on the collective thread once the caller's current stream of
  // `issuedOn`'s device has reached this call (any tensor of the op; undefined for none). With
  // `onCaller`, the calling thread runs it at once when no collective is queued or running.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::string description,
                                         std::vector<at::Tensor> outputs, const at::Tensor& issuedOn,
                                         std::chrono::milliseconds timeout, Task task,
                                         bool onCaller = false);
  // Runs one collective as number `seq` of this group (the caller holds the turn: running_).
  void runCollective(Queued& q, uint64_t seq);
  c10::intrusive_ptr<c10d::Work> pointToPoint(bool isSend, std::vector<at::Tensor>& tensors,
                                              int peer, int tag);
  void collectiveLoop();
  void watchdogLoop();
  void track(const c10::intrusive_ptr<WorkDicomm>& work);
  void failInflight();

  DicommOptions options_;
  std::unique_ptr<Communicator> comm_;
  AllreduceAlgorithm allreduceAlgorithm_ = AllreduceAlgorithm::kRing;  // resolved at construction

  std::mutex queueMu_;
  std::condition_variable queueCv_;
  std::deque<Queued> queue_;
  bool stopping_ = false;
  // A collective runs (on the collective thread, or on a caller: enqueue's onCaller); one at a
  // time, in the order of collectiveSeq_. Both guarded by queueMu_.
  bool running_ = false;
  uint64_t collectiveSeq_ = 0;
  // kShared: the host's segment, connected by the first allreduce (by whoever holds running_).
  std::unique_ptr<SharedSegment> segment_;
  bool segmentTried_ = false;
  std::atomic<uint64_t> issuedCollectives_{0};
  std::thread collectiveThread_;

  std::mutex watchMu_;
  std::condition_variable watchCv_;
  std::vector<c10::weak_intrusive_ptr<WorkDicomm>> inflight_;
  std::string pendingAbort_;  // set by transport threads, executed by the watchdog
  bool watchStop_ = false;
  std::thread watchdog_;

  mutable std::mutex abortMu_;
  std::atomic<bool> aborted_{false};
  std::string abortCause_;

  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<WorkDicomm>> coalesced_;
};

}  // namespace dicomm
