// A transport over one stream socket per peer, shared by `tcp` and `shm`.
//
// Frames on the socket: a fixed header (kind, envelope, address, sequence) then, for INLINE
// frames, the payload. `shm` additionally uses REMOTE frames: the payload stays in the sender's
// memory, the receiver copies it with process_vm_readv (cross-memory attach: one copy, no
// kernel socket buffers) and answers with an ACK frame that completes the send.
//
// Threads per pair: one receive thread (blocking reads; never waits on the user, so the socket
// always drains and two peers can never deadlock on full buffers) and one send thread for queued
// large messages. A small message is written by the calling thread itself when nothing is
// queued, which saves a thread hand-off on the latency path.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "comm/transport/Socket.h"
#include "comm/transport/Transport.h"

namespace dicomm {

struct StreamConfig {
  const char* name = "tcp";
  bool tcp = true;                 // AF_INET/6 (true) or abstract AF_UNIX (false)
  size_t remoteThreshold = SIZE_MAX;  // payloads >= this go by cross-memory attach
  // Payloads >= this (and not going by cross-memory attach) use request-to-send: the payload
  // follows only once the receiver has a matching receive, so it lands in place, never in a
  // bounce buffer.
  size_t rendezvousThreshold = 1 << 20;
  size_t inlineWriteMax = 256 << 10;  // caller-thread writes up to this size
};

class StreamPair : public Pair {
 public:
  StreamPair(int peer, Fd fd, Inbox* inbox, StreamConfig config, pid_t peerPid, bool remoteOk);
  ~StreamPair() override;
  int peer() const override { return peer_; }
  const char* transportName() const override { return config_.name; }
  void send(const Envelope& envelope, const void* data, MemoryKind memory,
            SendDone done) override;
  void close() override;

 private:
  // kRts: envelope only, the payload waits. kCts: the receiver is ready for `seq`.
  // kData: the payload of an earlier kRts.
  enum Kind : uint32_t {
    kInline = 1, kRemote = 2, kAck = 3, kGoodbye = 4, kRts = 5, kCts = 6, kData = 7
  };
  struct Frame {
    uint32_t kind = 0;
    int32_t status = 0;  // ACK: 0 ok, else errno of the receiver's copy
    Envelope envelope;
    uint64_t address = 0;
    uint64_t seq = 0;
  };
  struct Outgoing {
    Frame frame;
    const void* data = nullptr;
    size_t wireBytes = 0;
    SendDone done;
  };

  void rxLoop();
  void txLoop();
  void writeFrame(const Outgoing& out);  // throws TransportError
  void receivePayload(const Frame& frame);
  void pullRemote(const Frame& frame, void* dst);
  void pullAndAck(const Frame& frame, Landing landing);
  void queueControl(Kind kind, uint64_t seq, int32_t status = 0);
  void readInto(void* dst, size_t n, bool keep);
  void fail(const std::string& cause, bool cleanClose = false);
  std::exception_ptr failure() const;

  const int peer_;
  Fd fd_;
  Inbox* inbox_;
  StreamConfig config_;
  const pid_t peerPid_;
  const bool remoteOk_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Outgoing> queue_;
  std::map<uint64_t, SendDone> awaitingAck_;
  std::map<uint64_t, Outgoing> awaitingCts_;     // sent kRts, payload waits for kCts
  std::map<uint64_t, Landing> rendezvousLanding_;  // sent kCts, kData will land here
  uint64_t nextSeq_ = 1;
  bool txWriting_ = false;
  bool closing_ = false;
  bool failed_ = false;
  bool peerSaidGoodbye_ = false;
  std::string failure_;

  std::thread rx_;
  std::thread tx_;
};

class StreamTransport : public Transport {
 public:
  explicit StreamTransport(StreamConfig config) : config_(config) {}
  std::string name() const override { return config_.name; }
  void start(const TransportContext& context) override;
  std::unique_ptr<Pair> connect(int peer) override;

 private:
  std::string addressKey(int rank) const;
  StreamConfig config_;
  TransportContext ctx_;
  Listener listener_;
  std::mutex acceptMu_;
  std::map<int, std::pair<Fd, Hello>> accepted_;  // connections that arrived before connect(p)
};

// Whether this process may read sibling processes' memory (cross-memory attach).
bool crossMemoryAttachWorks();

}  // namespace dicomm
