// A pair whose messages take the time an emulated link would (EmulatedLinks.h): it wraps the
// pair that really moves the bytes (tcp, shm) and holds each message back until the fleet's
// link would have delivered it.
//
// Each message first takes its link for bytes / bandwidth * time scale, one quantum at a time
// (so messages of other pairs on the same link interleave with it), then waits its latency *
// time scale, and is then handed to the real pair. Messages leave in the order they were sent;
// the next message takes the link while the previous one waits out its latency, as on a wire.
// Its send completes when the real pair's does, so a blocking sender waits for the delivery.
// One thread per pair sleeps until the next quantum or delivery is due (a condition variable
// with a deadline): no core spins. Messages the core marks `immediate` (an abort notice) go out
// at once.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/transport/EmulatedLinks.h"
#include "comm/transport/Transport.h"

namespace dicomm {

class PacedPair : public Pair, public std::enable_shared_from_this<PacedPair> {
 public:
  // `link`: the shared occupancy of the link this pair's messages take; `spec`: its bandwidth
  // and latency, already bounded by both ends' NICs; `timeScale` multiplies both times.
  static std::shared_ptr<PacedPair> wrap(std::shared_ptr<Pair> inner, std::shared_ptr<LinkState> state,
                                         std::atomic<int64_t>* link, LinkClassSpec spec, double timeScale,
                                         std::string linkName, std::function<bool(uint64_t tag)> immediate);
  ~PacedPair() override;

  int peer() const override { return inner_->peer(); }
  const char* transportName() const override { return inner_->transportName(); }
  bool canAccessDevice(int deviceType) const override { return inner_->canAccessDevice(deviceType); }
  int connections() const override { return inner_->connections(); }
  std::string congestion() const override { return inner_->congestion(); }
  bool progress(const std::atomic<bool>& done, std::chrono::steady_clock::time_point until,
                bool block = false) override {
    return inner_->progress(done, until, block);
  }
  void unpark() override { inner_->unpark(); }
  void send(const Envelope& envelope, const void* data, MemoryKind memory, SendDone done) override;
  void close() override;

  // The link this pair's messages take ("inter_cluster dc0>dc1", ...) and its times.
  const std::string& linkName() const { return linkName_; }

 private:
  PacedPair(std::shared_ptr<Pair> inner, std::shared_ptr<LinkState> state, std::atomic<int64_t>* link,
            LinkClassSpec spec, double timeScale, std::string linkName, std::function<bool(uint64_t)> immediate);
  struct Message {
    Envelope envelope;
    const void* data = nullptr;
    MemoryKind memory = MemoryKind::kHost;
    SendDone done;
    int64_t postedNs = 0;
    int64_t dueNs = 0;  // when the link delivers it (set once it has taken the link)
  };
  void run();
  // Takes the next quantum of the message on the link (lock held).
  void takeQuantum();
  int64_t serializeNs(uint64_t nbytes) const;

  std::shared_ptr<Pair> inner_;
  std::shared_ptr<LinkState> state_;  // keeps `link_` mapped
  std::atomic<int64_t>* link_;
  LinkClassSpec spec_;
  double timeScale_;
  int64_t latencyNs_;
  std::string linkName_;
  std::function<bool(uint64_t)> immediate_;

  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::deque<Message> waiting_;    // not yet on the link, in send order
  bool onLink_ = false;            // the front of waiting_ is taking the link
  int64_t leftNs_ = 0;             // of its link time, not yet reserved
  int64_t quantumEndNs_ = 0;       // when its last reserved quantum ends
  int64_t lastEndNs_ = -1;         // where this pair's last quantum ended (-1: none)
  std::deque<Message> inFlight_;   // off the link, waiting out the latency (due ascending)
  std::thread thread_;
};

}  // namespace dicomm
