// A transport over stream sockets, shared by `tcp` and `shm`: it listens, publishes its address
// in the store, dials and admits peers through the handshake (Handshake.h), and hands each
// peer's connections to a StreamPair (StreamPair.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/transport/GreetingBound.h"
#include "comm/transport/Handshake.h"
#include "comm/transport/Socket.h"
#include "comm/transport/StreamConfig.h"
#include "comm/transport/Transport.h"

namespace dicomm {

class StreamTransport : public Transport {
 public:
  // Out of line: only StreamTransport.cpp includes c10d's Store (ListenAddress.h).
  explicit StreamTransport(StreamConfig config);
  ~StreamTransport() override;
  std::string name() const override { return config_.name; }
  void start(const TransportContext& context) override;
  std::shared_ptr<Pair> connect(int peer) override;

 private:
  std::string addressKey(int rank) const;
  StreamConfig config_;
  TransportContext ctx_;
  Listener listener_;
  std::shared_ptr<void> siblingReads_;  // shm: Yama lets peers read this process while held
  std::mutex acceptMu_;
  // Connections that arrived before connect(p) took them, by (rank, lane).
  std::map<std::pair<int, int>, std::pair<Fd, Hello>> accepted_;
  // Connections accepted but not yet admitted (under acceptMu_): reading the dialer's Hello,
  // then (once answered with ours and our proof) its proof. See Handshake.h.
  struct Greeting {
    Fd fd;
    bool answered = false;  // our Hello and proof went out; now reading the dialer's proof
    Hello theirs;
    Hello mine;
    uint8_t proof[sizeof(Proof)] = {0};
    size_t got = 0;  // bytes of the current stage's message received
    Clock::time_point deadline;
  };
  std::vector<Greeting> greeting_;
  static constexpr std::chrono::seconds kHelloWindow{10};
  // At most maxGreetings() connections are greeted at once (GreetingBound.h): one more evicts
  // the oldest (a real peer completes its handshake within milliseconds of connecting, so a flood
  // of idle connections evicts only its own). With nothing to evict when out of descriptors, the
  // listener rests (kAcceptRest, doubling) instead of spinning on a connection it cannot accept.
  size_t groupGreetings() const {
    return 64 + 2 * static_cast<size_t>(ctx_.size) * static_cast<size_t>(config_.lanes);
  }
  size_t maxGreetings() const { return greetingBound_.limit(groupGreetings()); }
  GreetingBound greetingBound_;
  static constexpr std::chrono::milliseconds kAcceptRest{1};
  static constexpr std::chrono::milliseconds kAcceptRestMax{100};
  Clock::time_point acceptRestUntil_{};
  std::chrono::milliseconds acceptRest_{0};
  size_t evicted_ = 0;  // greetings dropped for room (reported once per admitOnce call at INFO)
  void acceptOne();
  void evictOldestGreeting();
  // Wait until `until` for the listener and the greetings; move admitted ones to accepted_.
  // True when something arrived (the caller looks again), false on the timeout.
  bool admitOnce(Clock::time_point until);
  // One step of greeting `g` whose socket is readable; false drops the connection.
  bool advanceGreeting(Greeting& g);
  // Whether a dialer's Hello names a rank and lane of this group (before any proof).
  bool helloFieldsOk(const Hello& h) const;
  // shm: the connected process is the one the Hello names, run by this user (SO_PEERCRED).
  bool peerCredentialsOk(int fd, const Hello& h) const;
  // Dialer side of the handshake on a fresh connection to `peer`; throws naming the peer.
  void proveAsDialer(int fd, int peer, int lane, int lanes, Clock::time_point deadline,
                     Hello* theirs);
  // Store key where a dialer that gave up on `rank` says why (the accepting side polls it).
  std::string unreachableKey(int rank) const;
  // Dial `peer` at its published `address` within DICOMM_CONNECT_TIMEOUT; on failure tell the
  // peer through the store and throw naming both ranks, the address and what to set.
  Fd dialPeer(int peer, const std::string& address, Clock::time_point deadline);
  Fd takeAccepted(int peer, int lane, Clock::time_point deadline, Hello* theirs);
  Hello myHello(int lane, int lanes) const;
  static constexpr int kMaxLanes = 16;
};

}  // namespace dicomm
