// The ranks of one process group, connected: one Pair per peer (transport chosen per peer),
// the Mailbox that matches arrivals, and asynchronous send/receive of host byte ranges.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/core/Mailbox.h"
#include "comm/transport/EmulatedLinks.h"
#include "comm/transport/Transport.h"

namespace dicomm {

struct CommunicatorOptions {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  std::string transport = "auto";  // DICOMM_TRANSPORT: auto | tcp | shm | rdma
  // DICOMM_LISTEN_HOST; "" chooses the address of the interface that routes to the store.
  std::string listenHost;
  // Called once, on a transport thread, when a pair breaks; the owner decides what to abort.
  // Given here, not set after construction: a pair's threads start while the constructor still
  // runs, and a peer that fails then (a frame cut short right after the handshake) must not go
  // unheard, leaving its receives to time out.
  std::function<void(int peer, const std::string& cause)> onFailure;
};

// Transports compiled in / usable on this machine, in preference order.
std::vector<std::string> transportsBuilt();
std::vector<std::string> transportsUsable();
// What identifies "this host" for the shm transport: hostname, boot id and pid namespace.
std::string localHostId();

class Communicator {
 public:
  // Connects to every peer (blocking, up to options.timeout). Throws naming a missing rank.
  explicit Communicator(CommunicatorOptions options);
  ~Communicator();

  int rank() const { return options_.rank; }
  int size() const { return options_.size; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  // The transport serving `peer` ("tcp", "shm", "rdma"; "self" for this rank).
  std::string transportOf(int peer) const;
  // The transport asked for (DICOMM_TRANSPORT): "auto", or the one forced.
  const std::string& transportAsked() const { return options_.transport; }
  // Connections the pair to `peer` uses (tcp stripes large messages over several; 0 for self).
  int connectionsOf(int peer) const;
  // The TCP congestion control of the pair to `peer` ("" when it is not TCP, or for self).
  std::string congestionOf(int peer) const;
  // The emulated link to `peer` ("inter_cluster dc0>dc1 1 GB/s 20000 us x300"), "" when the
  // pair runs at host speed (no DICOMM_LINKS, or a class it does not name).
  std::string linkOf(int peer) const;

  // The group's ranks by host (same localHostId(); with emulated links, same host and node of
  // the fleet), hosts in the order of their lowest rank, ranks ascending within each; and the
  // index into hosts() of `rank`'s host.
  const std::vector<std::vector<int>>& hosts() const { return hosts_; }
  int hostOf(int rank) const { return hostIndex_.at(rank); }

  std::shared_ptr<Completion> isend(int peer, uint64_t tag, const void* data, size_t nbytes,
                                    int32_t dtype, Completion::Callback cb = nullptr);
  // peer == -1: any source.
  std::shared_ptr<Completion> irecv(int peer, uint64_t tag, void* data, size_t nbytes,
                                    int32_t dtype, Completion::Callback cb = nullptr);
  // Handle `peer`'s incoming messages on this thread until `done` or `until` (Pair::progress);
  // false when that is not possible now (the caller waits instead).
  bool progress(int peer, const std::atomic<bool>& done, std::chrono::steady_clock::time_point until,
                bool block = false);
  // Hand reading back to the transports' own threads (Pair::unpark) for `peer`, or every peer
  // when -1: before waiting for messages without polling for them.
  void unpark(int peer);
  // How long a waiter that does not poll sleeps on its peer's connection before it hands
  // reading back to the receive thread: long enough for a reply, short enough that a long wait
  // (a pipeline bubble) leaves the connection to the thread made for it.
  static constexpr std::chrono::milliseconds kBlockOnPeer{20};
  // How a thread waits for a transfer with `peer` before it sleeps on the transfer's own
  // condition. While the host is quiet it polls for the spin budget (PollPhase), reading the
  // peer's messages itself (progress()): no other thread needs waking, the receive thread's
  // wake-up included, and its completion's too. On a busy host (or with polling off) it sleeps
  // on the peer's connection until `blockUntil` instead (one wake-up per frame). Returns whether
  // `done`; if not, the transport's own thread reads for the caller from then on (unpark).
  // `comm` may be null and `peer` -1 (any source, a collective's Work): then it only watches
  // `done`.
  static bool awaitReading(Communicator* comm, int peer, const std::atomic<bool>& done,
                           std::chrono::steady_clock::time_point blockUntil);

  // Transfers posted (isend/irecv) by the calling thread so far, in any communicator: a
  // collective that fails compares it to know whether it left transfers behind.
  static uint64_t postedByThisThread();

  // Stop every transport thread, then fail all pending receives with `error`. Not callable from
  // a transport thread. Idempotent.
  void close(const std::exception_ptr& error);
  // close(), after telling every peer why (best effort), so their errors name the root cause.
  void abort(const std::string& cause);
  bool closed() const { return closed_.load(); }
  // Why close() was called (its error's text); empty while open.
  std::string closeCause() const;
  // Why `peer` left cleanly (it shut down its process group), which fails no op by itself; empty
  // while it has not. A wait outside the pairs (the shared segment) asks for its members.
  std::string peerLeftCause(int peer) { return mailbox_.closedCause(peer); }

 private:
  // Joining the group, in the constructor's order: a forced DICOMM_TRANSPORT is built and usable;
  // the auth key shared through the store (rank 0 makes it) and this rank's host and transports
  // published; a transport chosen per peer (returns the ranks on this host); ranks grouped by
  // host; the transports needed started; a pair connected to every peer.
  void checkForcedTransport() const;
  void waitForKey(const std::string& key, int who) const;
  std::vector<uint8_t> shareAuthKey(const std::string& myHost, const std::vector<std::string>& myUsable);
  int choosePairTransports(const std::string& myHost, const std::vector<std::string>& myUsable);
  void groupHosts();
  std::map<std::string, Transport*> startTransports(const std::vector<uint8_t>& authKey, int localRanks,
                                                    const std::string& myHost);
  void connectPairs(const std::map<std::string, Transport*>& started);
  // With DICOMM_LINKS: each pair to a peer over a named link class becomes a PacedPair.
  void paceLinks();
  // Throws when `listen` is a loopback address while a tcp peer is on another host.
  void checkListenReaches(const ListenAddress& listen, const std::string& myHost) const;
  std::string describeTransports() const;

  CommunicatorOptions options_;
  Mailbox mailbox_;
  std::vector<std::unique_ptr<Transport>> transports_;
  std::vector<std::shared_ptr<Pair>> pairs_;  // indexed by rank; null for self
  std::vector<std::string> pairTransport_;
  std::vector<std::string> peerHost_;  // host id of each rank (localHostId())
  LinkEmulation links_;                 // DICOMM_LINKS and this rank's place (EmulatedLinks.h)
  std::vector<LinkPlace> peerPlace_;    // each rank's place in the fleet, with emulated links
  std::vector<std::string> pairLink_;   // linkOf() of each rank
  std::vector<std::vector<int>> hosts_;
  std::vector<int> hostIndex_;
  mutable std::mutex closeMu_;
  std::atomic<bool> closed_{false};
  std::string closeCause_;  // guarded by closeMu_
};

}  // namespace dicomm
