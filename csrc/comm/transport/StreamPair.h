// A pair over stream sockets, shared by `tcp` and `shm` (StreamTransport.h connects them).
//
// Frames on a socket: a fixed header (kind, envelope, address, sequence) then, for INLINE
// frames, the payload. `shm` additionally uses REMOTE frames: the payload stays in the sender's
// memory, the receiver copies it with process_vm_readv (cross-memory attach: one copy, no
// kernel socket buffers) and answers with an ACK frame that completes the send.
//
// A pair has one or more connections ("lanes"). Lane 0 carries every control frame and every
// message in order, except that an answer (CTS, ACK) goes ahead of payload still queued. `tcp`
// opens extra lanes (DICOMM_TCP_STREAMS) for large rendezvous payloads: once the receiver has
// said where the payload lands (CTS), it is cut into PART frames of at most kMaxPartBytes,
// dealt round the lanes, written and read in parallel. One loopback TCP stream is bound by the wake-ups of its
// two copying threads, well below memory bandwidth; two streams nearly double it.
//
// Threads per lane: one receive thread (never waits on the user, so the socket always drains
// and two peers can never deadlock on full buffers) and one send thread for queued frames. The
// latency path skips both: a small message or a control frame is written by the calling thread
// itself when nothing is queued (no lock held while writing, and a reading thread never waits
// for buffer space), and a thread waiting for this peer's message reads the main lane itself
// (progress()). The main lane has one reader at a time (readMu_); while a waiting thread reads,
// the socket's events are masked in the receive thread's epoll set, so that thread sleeps
// instead of being woken by every frame it will not read.
//
// Parking: a poller whose op completed leaves the socket masked, betting that its thread is back
// for the next message soon (a ping-pong, a pipeline's send/recv loop). The next poller then
// pays no epoll_ctl, and a reply that lands in between wakes nobody: in an 8 B ping-pong this
// took 3-5 us off each hop. The receive thread takes over once nobody polled for kParkGrace, at
// once on a socket error, and when unpark() asks (a frame sent that solicits an answer: kRts,
// kRemote, kCts; the core before a wait that will not poll), so a frame nobody polls for waits
// at most kParkGrace.
//
// Small-frame ring (shm only): each side creates a SmallFrameRing for what it receives and
// offers it (kRingOffer, the memfd's descriptor number; the peer opens it through /proc). A
// small message sent on the latency path goes into the peer's ring instead of the socket while
// a thread there polls (SmallFrameRing: the reader is awake), so neither side makes a system
// call; otherwise, or when the ring is full, it goes on the socket as before, and a reader that
// went away while the message was published gets a kRingBell on the socket. Order across the
// two paths: every message (kInline, kRemote, kRts) carries the pair's next sequence number, a
// message enters the ring only while the main lane is claimed idle (everything before it is
// already written to the socket), and the reader takes a ring message only after every earlier
// sequence number, reading the socket first where one is missing there.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/transport/FailureLatch.h"
#include "comm/transport/RendezvousBook.h"
#include "comm/transport/SmallFrameRing.h"
#include "comm/transport/Socket.h"
#include "comm/transport/StreamConfig.h"
#include "comm/transport/Transport.h"

namespace dicomm {

class StreamPair : public Pair, public std::enable_shared_from_this<StreamPair> {
 public:
  // A running pair. `fds[0]` is the main connection, the rest are data lanes (see the top of
  // this file). Its threads hold it until they exit (Transport.h).
  static std::shared_ptr<StreamPair> start(int peer, std::vector<Fd> fds, Inbox* inbox,
                                           StreamConfig config, pid_t peerPid, bool remoteOk);
  StreamPair(int peer, std::vector<Fd> fds, Inbox* inbox, StreamConfig config, pid_t peerPid,
             bool remoteOk);
  ~StreamPair() override;
  int peer() const override { return peer_; }
  const char* transportName() const override { return config_.name; }
  int connections() const override { return static_cast<int>(lanes_.size()); }
  std::string congestion() const override;
  void send(const Envelope& envelope, const void* data, MemoryKind memory,
            SendDone done) override;
  bool progress(const std::atomic<bool>& done, Clock::time_point until,
                bool block = false) override;
  void close() override;
  void unpark() override;

 private:
  // kRts: envelope only, the payload waits. kCts: the receiver is ready for `seq`.
  // kData: the payload of an earlier kRts. kPart: `envelope.nbytes` bytes of it at offset
  // `address`, on any lane.
  // kRingOffer: `address` is the descriptor of the sender's receive ring, `seq` its size in
  // bytes. kRingBell: look at the ring (the reader went away while a message was published).
  enum Kind : uint32_t {
    kInline = 1, kRemote = 2, kAck = 3, kGoodbye = 4, kRts = 5, kCts = 6, kData = 7, kPart = 8,
    kRingOffer = 9, kRingBell = 10
  };
  // One cache line: a header that is not a multiple of the cache line slowed large payloads
  // that follow it in the same socket to about half speed (docs/dicomm.md).
  struct Frame {
    uint32_t kind = 0;
    int32_t status = 0;  // ACK: 0 ok, else errno of the receiver's copy
    Envelope envelope;
    uint64_t address = 0;
    uint64_t seq = 0;
    uint64_t reserved[2] = {0, 0};
  };
  static_assert(sizeof(Frame) == 64, "a frame is one cache line (see above)");
  static_assert(sizeof(Frame) == SmallFrameRing::kHeaderBytes, "a ring slot holds one frame header");
  struct Outgoing {
    Frame frame;
    const void* data = nullptr;
    size_t wireBytes = 0;
    size_t headerSent = 0;  // bytes of `frame` already written (a control frame cut short)
    SendDone done;
  };
  // One connection with its send queue and threads (guarded by the pair's mu_).
  struct Lane {
    Fd fd;
    std::deque<Outgoing> queue;
    std::condition_variable cv;
    bool writing = false;  // a thread is writing this lane: the send thread waits its turn
    std::thread rx, tx;
  };
  void mainRxLoop();
  // Reads one frame from the main lane and handles it (the caller holds readMu_). False once the
  // pair is down (EOF or failure, already reported). Throws TransportError.
  bool readMainFrame();
  // The main lane through rxBuf_ (caller holds readMu_): exactly n bytes; false on EOF before
  // the first byte when `eofOk`, else EOF throws.
  bool readMain(void* dst, size_t n, bool eofOk);
  ssize_t fillMain(bool block);  // bytes added, 0 on EOF, -1 if it would block (block=false)
  bool mainReadable();           // a frame has started: buffered bytes, or the socket has some
  void watchMain(bool on);  // unmask (true) or mask the main socket in the receive thread's epoll set
  void unmaskLocked();      // the receive thread reads again (caller holds readMu_)
  // Whether a receive thread that woke (`alarm`: epoll reported an error or hang-up) while the
  // socket is masked should take over from a poller that parked it (caller holds readMu_).
  bool parkOver(bool alarm) const;
  static constexpr std::chrono::milliseconds kParkGrace{1};
  // A rendezvous payload goes out in parts of at most this size, and an answer (kCts, kAck)
  // queued meanwhile on the main lane goes ahead of the parts still queued there: it waits for
  // one part, not the whole payload. Without that, on a slow link the two directions of a pair
  // exchanging large messages took turns (a CTS waited behind its rank's own payload; 2 ranks
  // over 1 Gbit/s moved 32 MiB each way in 0.54 s instead of 0.28 s: docs/dicomm.md).
  static constexpr size_t kMaxPartBytes = size_t(512) << 10;
  void laneRxLoop(Lane& lane);
  void txLoop(Lane& lane);
  void writeFrame(Lane& lane, const Outgoing& out);  // throws TransportError
  // The three writers of a lane (the send thread, send()'s latency path, a control frame) take
  // turns through `writing`, never holding mu_ while they write (the receive threads need it):
  // a caller claims an idle lane (nothing queued, nobody writing; mu_ held) or queues behind.
  bool claimIdleLocked(Lane& lane);
  void releaseLane(Lane& lane);  // writing = false; wakes the send thread if frames queued
  void receivePayload(const Frame& frame);
  // Ring pollerBell_ if a thread is in progress(): an op completed on a lane's thread.
  void wakePoller();
  void receivePart(Lane& lane, const Frame& frame);
  // The protocol error for a rendezvous sequence announced while one of that number is pending
  // (its landing would have nowhere to go, and its receive would wait forever).
  std::string announcedTwice(uint64_t seq) const;
  // "<transport>: protocol error from rank <peer>: <what>".
  std::string protocolError(const std::string& what) const;
  void sendRendezvousPayload(Outgoing payload);  // after kCts: one kData or parts on all lanes
  void pullRemote(const Frame& frame, void* dst);
  void pullAndAck(const Frame& frame, Landing landing);
  void queueControl(Kind kind, uint64_t seq, int32_t status = 0, uint64_t address = 0);
  // The peer's ring offer: map it as ringOut_ (a ring that cannot be opened is logged and left
  // out: small messages then take the socket).
  void acceptRingOffer(const Frame& frame);
  // Takes the ring's messages, in order, up to (not including) sequence `below`, stopping at one
  // whose predecessor has not been read from the socket yet (caller holds readMu_). Whether any.
  bool drainRing(uint64_t below);
  void readInto(Lane& lane, void* dst, size_t n, bool keep);
  void fail(const std::string& cause, bool cleanClose = false);
  // fail() for a write that broke; returns the error for the op that was writing (the pair's
  // failure, which may be the peer's abort notice rather than this write's errno).
  std::exception_ptr failWrite(const std::string& cause);
  static constexpr std::chrono::milliseconds kReaderGrace{500};
  // How long a clean goodbye waits for the data lanes to deliver what was sent before it.
  static constexpr std::chrono::seconds kDrainGrace{10};
  void shutdownLanes();
  // Takes every pending completion out of the pair (under mu_), to be failed outside the lock.
  struct Orphans {
    std::vector<Outgoing> sends;
    std::vector<SendDone> acks;
    std::vector<Landing> landings;
    void failAll(const std::exception_ptr& error);
  };
  Orphans takePendingLocked();

  const int peer_;
  Inbox* inbox_;
  StreamConfig config_;
  const pid_t peerPid_;
  const bool remoteOk_;
  std::vector<std::unique_ptr<Lane>> lanes_;  // [0]: main connection
  Lane& main_;
  Fd mainReady_;                   // epoll set the main receive thread sleeps on
  Fd parkBell_;                    // eventfd in that set: a poller parked while it slept untimed
  Fd pollerBell_;                  // eventfd a blocking poller sleeps on beside the main lane
  // The main lane's reading protocol. Invariants (each step that relies on one says so):
  //  R1 only readMu_'s holder reads the main socket or rxBuf_, and it records itself in reader_;
  //  R2 masked_ (socket events off in mainReady_) changes only under readMu_; a poller masks it
  //     while it reads, and may leave it masked when it lets go ("parks", parkedAt_ = when);
  //  R3 a parked socket is unmasked by whoever next holds readMu_ once parkOver() says so (an
  //     error or hang-up, unparkWanted_, or kParkGrace since parkedAt_), so a frame nobody polls
  //     for waits at most kParkGrace;
  //  R4 the receive thread never sleeps untimed on a parked socket: it sets sleepsUntimed_
  //     before reading masked_, a parking poller sets masked_ before reading sleepsUntimed_ and
  //     rings parkBell_ if set, so one of the two sees the other;
  //  R5 rxBuf_ is empty whenever readMu_ is free, unless down_ (the holder handles every
  //     buffered frame);
  //  R6 down_ set means nobody starts reading again; after close() no thread calls inbox_.
  std::mutex readMu_;              // one reader of the main lane at a time
  // What the main lane's reader received beyond the frame it handles: a small message arrives
  // with its header in one recv(). Empty whenever readMu_ is free.
  struct RxBuffer {
    std::vector<char> bytes = std::vector<char>(16 << 10);
    size_t begin = 0, end = 0;
    size_t size() const { return end - begin; }
  };
  RxBuffer rxBuf_;
  std::atomic<std::thread::id> reader_{};  // its holder (close() from it must not relock)
  std::atomic<bool> polling_{false};       // a waiting thread reads the main lane
  // The main socket's events are masked: a poller reads, or parked it (set under readMu_).
  std::atomic<bool> masked_{false};
  std::atomic<int64_t> parkedAt_{0};       // steady-clock ns when the last poller parked
  std::atomic<bool> unparkWanted_{false};  // unpark() found readMu_ held: its holder unmasks
  std::atomic<bool> sleepsUntimed_{false};  // the receive thread waits with no timeout
  std::atomic<bool> down_{false};          // failed or closing: threads and pollers leave

  std::mutex mu_;
  FailureLatch latch_;
  std::condition_variable downCv_;  // latch_ went down
  std::map<uint64_t, SendDone> awaitingAck_;
  std::map<uint64_t, Outgoing> awaitingCts_;  // sent kRts, payload waits for kCts
  RendezvousBook incoming_;                   // sent kCts, kData/kPart will land here
  int dataLanesOpen_;                         // data lanes whose receive thread still runs
  uint64_t nextSeq_ = 1;
  bool peerSaidGoodbye_ = false;
  // shm: the ring this side reads (created with the pair, offered to the peer; used under
  // readMu_) and the peer's, which send() writes on the latency path (set once under mu_).
  std::unique_ptr<SmallFrameRing> ringIn_;
  std::unique_ptr<SmallFrameRing> ringOut_;
  uint64_t lastMessageSeq_ = 0;  // readMu_: the newest message sequence handled (either path)
};

}  // namespace dicomm
