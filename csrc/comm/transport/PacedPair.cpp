#include "comm/transport/PacedPair.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace dicomm {

namespace {

// A message takes its link this much link time at a time, so that concurrent messages of other
// pairs interleave with it (a fair link); short enough that two flows share a 1 MiB message
// evenly, long enough that the pacing thread wakes a few hundred times a second at most.
constexpr int64_t kQuantumNs = 2'000'000;

}  // namespace

std::shared_ptr<PacedPair> PacedPair::wrap(std::shared_ptr<Pair> inner, std::shared_ptr<LinkState> state,
                                           std::atomic<int64_t>* link, LinkClassSpec spec, double timeScale,
                                           std::string linkName, std::function<bool(uint64_t)> immediate) {
  std::shared_ptr<PacedPair> pair(new PacedPair(std::move(inner), std::move(state), link, spec, timeScale,
                                                std::move(linkName), std::move(immediate)));
  // The thread holds the pair until it exits (after close()), as the transports' threads do.
  pair->thread_ = std::thread([self = pair] { self->run(); });
  return pair;
}

PacedPair::PacedPair(std::shared_ptr<Pair> inner, std::shared_ptr<LinkState> state, std::atomic<int64_t>* link,
                     LinkClassSpec spec, double timeScale, std::string linkName,
                     std::function<bool(uint64_t)> immediate)
    : inner_(std::move(inner)),
      state_(std::move(state)),
      link_(link),
      spec_(spec),
      timeScale_(timeScale),
      latencyNs_(static_cast<int64_t>(std::llround(spec.latencySeconds * timeScale * 1e9))),
      linkName_(std::move(linkName)),
      immediate_(std::move(immediate)) {}

PacedPair::~PacedPair() {
  if (thread_.joinable()) thread_.detach();  // only reached from the thread's own last reference
}

int64_t PacedPair::serializeNs(uint64_t nbytes) const {
  return static_cast<int64_t>(std::llround(static_cast<double>(nbytes) / spec_.bytesPerSecond * timeScale_ * 1e9));
}

void PacedPair::send(const Envelope& envelope, const void* data, MemoryKind memory, SendDone done) {
  if (immediate_ && immediate_(envelope.tag)) {
    inner_->send(envelope, data, memory, std::move(done));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      waiting_.push_back(Message{envelope, data, memory, std::move(done), steadyNowNs(), 0});
      wake_.notify_one();
      return;
    }
  }
  done(std::make_exception_ptr(TransportError(
      peer(), "dicomm: pair to rank " + std::to_string(peer()) + " was closed locally")));
}

void PacedPair::takeQuantum() {
  const int64_t duration = std::min(leftNs_, kQuantumNs);
  const int64_t start = LinkState::reserve(link_, duration, lastEndNs_);
  quantumEndNs_ = start + duration;
  lastEndNs_ = quantumEndNs_;
  leftNs_ -= duration;
}

void PacedPair::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const int64_t now = steadyNowNs();
    if (!inFlight_.empty() && inFlight_.front().dueNs <= now) {
      Message m = std::move(inFlight_.front());
      inFlight_.pop_front();
      lock.unlock();
      inner_->send(m.envelope, m.data, m.memory, std::move(m.done));
      lock.lock();
      continue;
    }
    if (onLink_ && quantumEndNs_ <= now) {
      if (leftNs_ > 0) {
        takeQuantum();
      } else {
        Message m = std::move(waiting_.front());
        waiting_.pop_front();
        m.dueNs = quantumEndNs_ + latencyNs_;
        inFlight_.push_back(std::move(m));
        onLink_ = false;
      }
      continue;
    }
    if (!onLink_ && !waiting_.empty()) {
      // Back to back with this pair's previous message only when it was posted before that one
      // left the link; otherwise the link sat idle for this pair in between.
      if (lastEndNs_ >= 0 && waiting_.front().postedNs > lastEndNs_) lastEndNs_ = -1;
      leftNs_ = serializeNs(waiting_.front().envelope.nbytes);
      quantumEndNs_ = lastEndNs_ >= 0 ? lastEndNs_ : now;
      onLink_ = true;
      if (leftNs_ > 0) takeQuantum();
      continue;
    }
    int64_t next = std::numeric_limits<int64_t>::max();
    if (onLink_) next = quantumEndNs_;
    if (!inFlight_.empty()) next = std::min(next, inFlight_.front().dueNs);
    if (next == std::numeric_limits<int64_t>::max()) {
      wake_.wait(lock);
    } else {
      wake_.wait_until(lock, std::chrono::steady_clock::time_point(std::chrono::nanoseconds(next)));
    }
  }
}

void PacedPair::close() {
  std::deque<Message> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
    pending = std::move(waiting_);
    for (auto& m : inFlight_) pending.push_back(std::move(m));
    inFlight_.clear();
  }
  wake_.notify_all();
  if (thread_.joinable()) {
    if (std::this_thread::get_id() == thread_.get_id()) {
      thread_.detach();  // a completion on the pacing thread closed the group
    } else {
      thread_.join();
    }
  }
  for (auto& m : pending) {
    m.done(std::make_exception_ptr(TransportError(
        peer(), "dicomm: pair to rank " + std::to_string(peer()) + " was closed locally")));
  }
  inner_->close();
}

}  // namespace dicomm
