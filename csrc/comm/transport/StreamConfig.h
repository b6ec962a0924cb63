// The knobs of a stream transport (`tcp`, `shm`): thresholds between its message protocols,
// lanes per pair, socket options and timeouts; each from the defaults, then the environment.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace dicomm {

struct StreamConfig {
  const char* name = "tcp";
  bool tcp = true;                 // AF_INET/6 (true) or abstract AF_UNIX (false)
  size_t remoteThreshold = SIZE_MAX;  // payloads >= this go by cross-memory attach
  // Copy a large cross-memory payload with two threads: one process_vm_readv stream stays well
  // under memcpy speed. Only while this host has a core per local rank (set by start()): with
  // more ranks than cores the helper only adds switches.
  bool parallelPull = true;
  // Payloads >= this (and not going by cross-memory attach) use request-to-send: the payload
  // follows only once the receiver has a matching receive, so it lands in place, never in a
  // bounce buffer.
  size_t rendezvousThreshold = 1 << 20;
  size_t inlineWriteMax = 256 << 10;  // caller-thread writes up to this size
  // shm: small messages through a ring in shared memory while the receiver polls
  // (SmallFrameRing.h; DICOMM_SHM_RING, 1 by default, 0 keeps them on the socket).
  bool smallFrameRing = false;
  // How long a receive thread polls for the next frame before it sleeps (spinBudget()).
  std::chrono::microseconds spin{0};
  // Kernel socket buffer size; 0 keeps the kernel's auto-tuning (DICOMM_SOCKET_BUFFER).
  int socketBuffer = 0;
  // Connections per pair (tcp: DICOMM_TCP_STREAMS, default min(4, CPUs)), and the smallest
  // rendezvous payload split over them (DICOMM_STRIPE_BYTES).
  int lanes = 1;
  size_t stripeMin = 1 << 20;
  // TCP congestion control (DICOMM_TCP_CONGESTION): "auto" puts reno on connections that stay
  // on this host and keeps the system's choice elsewhere; "system" always keeps it; any other
  // value is an algorithm set on every connection. Congestion control has nothing to control
  // within a host, and a pacing one (BBR on lo, which has no fq qdisc, paces every segment
  // from a timer) costs there (docs/dicomm.md).
  std::string congestion = "auto";
  // tcp: a peer host that stops answering fails the pair after this many seconds (keepalive and
  // TCP_USER_TIMEOUT; DICOMM_PEER_TIMEOUT, 0 = only at the op timeout), and a dial that is not
  // answered gives up after connectTimeout seconds (DICOMM_CONNECT_TIMEOUT). Addresses are
  // published only once their listener is up, so a peer that does not answer within seconds
  // will not: it is unreachable from here.
  int peerTimeoutS = 10;
  int connectTimeoutS = 10;
  // The algorithm to set on connected socket `fd`, or "" to keep the system's.
  std::string congestionFor(int fd) const;

  // The knobs above from the environment; a bad value throws naming the variable.
  void applyEnv();
  static int defaultLanes();
};

}  // namespace dicomm
