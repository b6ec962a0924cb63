// Matching of arriving messages to posted receives (the core's side of transport::Inbox).
//
// A message matches the oldest posted receive with the same (source, tag), or an any-source
// receive with the same tag, whichever was posted first. A message that arrives before its
// receive is posted lands in a buffer of its own and is copied out when the receive arrives.
// Size and dtype are checked against the envelope before a byte is written: a mismatch fails
// the receive with both sides' view, and the payload is dropped.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/transport/Transport.h"

namespace dicomm {

// One outstanding send or receive; completes once, with an error or not.
class Completion {
 public:
  using Callback = std::function<void(Completion&)>;
  explicit Completion(Callback cb = nullptr) : callback_(std::move(cb)) {}
  void complete(std::exception_ptr error, int source = -1);
  bool done() const { return done_.load(std::memory_order_acquire); }
  const std::atomic<bool>& doneFlag() const { return done_; }  // for Communicator::awaitReading
  std::exception_ptr error() const { return error_; }
  int source() const { return source_; }
  // Sleep until done or `until`; returns done(). Callers poll first (Communicator::awaitReading).
  bool waitUntil(std::chrono::steady_clock::time_point until);

 private:
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
  int source_ = -1;
  std::mutex mu_;
  std::condition_variable cv_;
  Callback callback_;
};

struct RecvRequest {
  int peer = -1;  // -1: any source
  uint64_t tag = 0;
  void* data = nullptr;
  size_t nbytes = 0;
  int32_t dtype = -1;
  std::shared_ptr<Completion> completion;
  uint64_t order = 0;  // post order, to pick between a (peer, tag) and an any-source receive
};

// The largest payload a peer may announce (DICOMM_MAX_MESSAGE_BYTES, default 1 TiB): a
// header claiming more is a protocol error, before anything is allocated or matched.
uint64_t maxMessageBytes();

// Throws TransportError naming `peer` when an arriving envelope is malformed: an unknown tag
// kind, a point-to-point tag with bits beyond its 32, a control tag that is not the abort
// notice, a dtype that is no c10::ScalarType, or a size above maxMessageBytes().
void checkEnvelope(int peer, const Envelope& envelope);

class Mailbox : public Inbox {
 public:
  // `onPeerFailed` runs on the transport thread that saw the failure. It is fixed here, before
  // any transport can report one, and never reassigned: transport threads read it unlocked.
  explicit Mailbox(int rank, std::function<void(int, const std::string&)> onPeerFailed = nullptr)
      : rank_(rank), onPeerFailed_(std::move(onPeerFailed)) {}
  void post(RecvRequest request);
  // Fail every posted receive, and every receive posted from now on (the communicator was
  // aborted). Transports must be stopped first.
  void failAll(const std::exception_ptr& error);

  Landing arrive(int peer, const Envelope& envelope) override;
  void arriveWhenPosted(int peer, const Envelope& envelope,
                        std::function<void(Landing)> ready) override;
  void peerFailed(int peer, const std::string& cause) override;
  void peerClosed(int peer, const std::string& cause) override;
  std::string abortNotice(int peer) override;
  // Why `peer` closed its pair cleanly (it shut down its process group); empty while it has not.
  std::string closedCause(int peer);

 private:
  struct Unexpected {
    int peer;
    Envelope envelope;
    std::unique_ptr<char[]> data;
    bool complete = false;
    std::exception_ptr error;
    std::shared_ptr<RecvRequest> claimedBy;
    uint64_t order;
    std::function<void(Landing)> deferred;  // rendezvous: payload still at the sender
  };
  using Key = std::pair<int, uint64_t>;

  std::exception_ptr mismatch(const RecvRequest& request, int peer, const Envelope& env) const;
  // A message no receive has claimed yet, queued in arrival order (lock held).
  std::shared_ptr<Unexpected> queueUnexpectedLocked(int peer, const Envelope& envelope);
  // Match `envelope` against posted receives (lock held); null when none matches.
  std::shared_ptr<RecvRequest> takePosted(int peer, const Envelope& envelope);
  // The landing of a matched receive (lock not held); fails it on a size/dtype mismatch.
  Landing landingFor(const std::shared_ptr<RecvRequest>& r, int peer, const Envelope& envelope);
  static void deliver(Unexpected& message, RecvRequest& request);

  const int rank_;
  std::mutex mu_;
  uint64_t nextOrder_ = 0;
  std::map<Key, std::deque<std::shared_ptr<RecvRequest>>> posted_;
  std::map<uint64_t, std::deque<std::shared_ptr<RecvRequest>>> postedAny_;
  std::map<Key, std::deque<std::shared_ptr<Unexpected>>> unexpected_;
  const std::function<void(int, const std::string&)> onPeerFailed_;
  std::map<int, std::string> closedPeers_;  // peer -> why; receives from them fail at once
  // Set by failAll: a receive that passed the communicator's closed check just before the
  // abort must fail here, under mu_, rather than wait in posted_ for its timeout.
  std::exception_ptr failed_;
  std::map<int, std::string> abortNotices_;  // peer -> the cause it sent before aborting
};

}  // namespace dicomm
