#include "comm/backend/WorkDicomm.hpp"

#include <stdexcept>

#include "comm/backend/ProcessGroupDicomm.hpp"
#include "comm/core/Communicator.h"
#include "comm/transport/Env.h"
#include "comm/transport/Trace.h"

namespace dicomm {

WorkDicomm::WorkDicomm(ProcessGroupDicomm* backend, int rank, c10d::OpType type,
                       std::string description, std::vector<at::Tensor> outputs,
                       std::chrono::milliseconds timeout)
    : Work(rank, type),
      backend_(backend),
      description_(std::move(description)),
      outputs_(std::move(outputs)),
      timeout_(timeout),
      deadline_(std::chrono::steady_clock::now() + timeout) {}

c10::intrusive_ptr<c10::ivalue::Future> WorkDicomm::getFuture() {
  // Made on first request: most p2p ops never ask, and a future costs an allocation and, on
  // completion, a walk over the outputs' storages.
  std::lock_guard<std::mutex> lock(mutex_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    if (completed_) complete(*future_, exception_, outputs_);
  }
  return future_;
}

void WorkDicomm::complete(c10::ivalue::Future& future, const std::exception_ptr& error,
                          const std::vector<at::Tensor>& outputs) {
  if (error) {
    future.setErrorIfNeeded(error);
  } else {
    future.markCompleted(c10::IValue(outputs));
  }
}

int WorkDicomm::sourceRank() const {
  int s = source_.load();
  TORCH_CHECK(s >= 0, "dicomm: sourceRank() is only defined for a completed receive from any "
                      "source (", description_, ")");
  return s;
}

std::exception_ptr WorkDicomm::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return exception_;
}

void WorkDicomm::markDone(std::exception_ptr error, int source) {
  std::vector<std::function<void(WorkDicomm&)>> callbacks;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return;
    if (error) {
      std::string cause;
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        cause = e.what();
      } catch (...) {
        cause = "unknown error";
      }
      // After an abort, the abort's cause explains every failure better than "pair closed".
      if (backend_->aborted()) cause = "communicator aborted: " + backend_->abortCause();
      if (cause.rfind("dicomm " + description_, 0) != 0) {
        cause = "dicomm " + description_ + " failed: " + cause;
      }
      error = std::make_exception_ptr(std::runtime_error(cause));
    }
    if (source >= 0) source_.store(source);
    completed_ = true;
    exception_ = error;
    done_.store(true, std::memory_order_release);
    callbacks.swap(callbacks_);
    future = future_;  // null if nobody asked yet: getFuture() completes it then
  }
  cv_.notify_all();
  if (future) complete(*future, error, outputs_);
  for (auto& cb : callbacks) cb(*this);
}

void WorkDicomm::onDone(std::function<void(WorkDicomm&)> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!completed_) {
      callbacks_.push_back(std::move(fn));
      return;
    }
  }
  fn(*this);
}

bool WorkDicomm::wait(std::chrono::milliseconds timeout) {
  // DICOMM_TRACE: the wait of a point-to-point op, entered and left.
  const bool traced = trace::enabled() && (opType_ == c10d::OpType::SEND || opType_ == c10d::OpType::RECV);
  const bool isSend = opType_ == c10d::OpType::SEND;
  if (traced) trace::mark(isSend ? trace::kSendWaitIn : trace::kRecvWaitIn);
  struct Out {
    bool on, send;
    ~Out() {
      if (on) trace::mark(send ? trace::kSendWaitOut : trace::kRecvWaitOut);
    }
  } out{traced, isSend};
  if (done_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }
  // Small messages complete within microseconds: poll (reading the peer's messages on this
  // thread for a point-to-point op) before sleeping on the condition below.
  auto blockUntil = std::min(deadline_, std::chrono::steady_clock::now() + Communicator::kBlockOnPeer);
  if (timeout != kNoTimeout) blockUntil = std::min(blockUntil, std::chrono::steady_clock::now() + timeout);
  Communicator::awaitReading(comm_, peer_, done_, blockUntil);
  auto until = deadline_ + kTimeoutGrace;
  if (timeout != kNoTimeout) until = std::min(until, std::chrono::steady_clock::now() + timeout);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait_until(lock, until, [&] { return completed_; });
  }
  if (!done_.load() && timeout != kNoTimeout && std::chrono::steady_clock::now() < deadline_) {
    // torch's contract (and gloo's): the wait raises; the op itself stays in flight, bounded by
    // its own timeout, and may still be waited for.
    throw std::runtime_error("dicomm " + description_ + ": wait(timeout=" +
                             std::to_string(timeout.count()) + " ms) expired; the operation is " +
                             "still in flight (its own timeout is " +
                             std::to_string(timeout_.count()) + " ms)");
  }
  if (!done_.load()) {
    backend_->abortWith("dicomm " + description_ + " timed out after " +
                        std::to_string(timeout_.count()) + " ms");
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return completed_; });  // abort fails every pending work
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

void WorkDicomm::abort() { backend_->abortWith("dicomm " + description_ + ": Work.abort() called"); }

}  // namespace dicomm
