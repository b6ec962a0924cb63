// The handle of one dicomm op: waits with the op's deadline, carries a future (DDP's comm hooks
// need getFuture) and, for a receive from any source, the rank that sent.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace dicomm {

// How long after an op's deadline a waiter or the group's watchdog aborts the group itself. The
// collective's own thread reports the timeout at the deadline, naming the rank it waits for;
// the others step in a moment later, for an op whose thread cannot (p2p ops have none).
constexpr auto kTimeoutGrace = std::chrono::milliseconds(500);

class Communicator;
class ProcessGroupDicomm;

class WorkDicomm : public c10d::Work {
 public:
  WorkDicomm(ProcessGroupDicomm* backend, int rank, c10d::OpType type, std::string description,
             std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  bool isCompleted() override { return done_.load(std::memory_order_acquire); }
  int sourceRank() const override;
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  void abort() override;

  // Completes the work once (later calls are ignored). `error` is reworded to name this op.
  void markDone(std::exception_ptr error, int source = -1);
  // Runs `fn` once the work is done (immediately if it already is).
  void onDone(std::function<void(WorkDicomm&)> fn);
  // The one peer whose messages complete this op: wait() reads them itself while it polls
  // (Communicator::progress), and hands reading back to the transport before it sleeps.
  void pollPeer(Communicator* comm, int peer) {
    comm_ = comm;
    peer_ = peer;
  }

  const std::string& description() const { return description_; }
  std::chrono::steady_clock::time_point deadline() const { return deadline_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  std::exception_ptr error() const;

 private:
  ProcessGroupDicomm* backend_;  // outlives its works (shutdown fails them first)
  std::string description_;
  std::vector<at::Tensor> outputs_;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point deadline_;
  static void complete(c10::ivalue::Future& future, const std::exception_ptr& error,
                       const std::vector<at::Tensor>& outputs);
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // guarded by mutex_; made by getFuture()
  std::atomic<bool> done_{false};
  Communicator* comm_ = nullptr;  // with peer_: set by pollPeer()
  int peer_ = -1;
  std::atomic<int> source_{-1};
  std::vector<std::function<void(WorkDicomm&)>> callbacks_;  // guarded by mutex_
};

}  // namespace dicomm
