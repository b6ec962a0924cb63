// rdma: DiComm's device-direct transport on libibverbs.
//
// One reliable-connected queue pair per peer; QPN, LID, GID and PSN travel through the c10d
// store. Per pair, one completion queue on its own completion channel and one progress
// thread that sleeps on the channel when idle (after a short spin), so an idle rank burns no
// core. Wire protocol (every SEND starts with a `Ctrl` header):
//   EAGER  payload <= eagerMax, copied through a pre-registered bounce slot (inline when the
//          QP allows); the receiver copies it from its posted bounce slot into the landing.
//   RTS    a larger payload: the sender announces it; once a receive matches
//          (Inbox::arriveWhenPosted) the receiver registers that memory (MrCache) and answers
//          CTS with address and rkey; the
//          sender RDMA-writes straight from its buffer into the landing (chunks, the last with
//          immediate = the transfer id), and the receiver's posted recv completes it. No
//          staging copy on either side: this is the device-direct path for host-addressable
//          device memory (the emu dipu vendor) and host tensors.
//   CTS    answer to RTS (ok / drop: the core rejected the message / error: registration
//          failed, with errno).
//   KEEPALIVE  sent when a pair was idle for keepaliveMs: a dead peer makes it fail with a
//          retry-exceeded completion, which fails every pending op of that peer.
//   GOODBYE    the peer shut down its process group.
// Receive slots are reposted as soon as their content is consumed; a sender that outruns the
// receiver waits on RNR retries (infinite) rather than failing.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/transport/FailureLatch.h"
#include "comm/transport/Transport.h"
#include "comm/transport/rdma/MemoryRegistry.h"
#include "comm/transport/rdma/Verbs.h"

namespace dicomm {
namespace rdma {

struct Config {
  size_t eagerMax = 32 << 10;      // DICOMM_RDMA_EAGER: largest payload sent through a bounce slot
  int sendSlots = 64;              // DICOMM_RDMA_SEND_SLOTS
  int recvSlots = 128;             // DICOMM_RDMA_RECV_SLOTS
  size_t writeChunk = 8 << 20;     // one RDMA write work request moves at most this much
  int keepaliveMs = 1000;          // DICOMM_RDMA_KEEPALIVE_MS
  int spinUs = 50;                 // DICOMM_RDMA_SPIN_US: poll this long before sleeping
  // DICOMM_RDMA_TIMEOUT_EXP: ack timeout 4.096 us * 2^16 = 268 ms, 6 retries: a dead peer
  // is noticed within ~2 s of the next keepalive or send.
  int timeoutExponent = 16;
  static Config fromEnv();
};

// Everything a process shares across its pairs: device, protection domain, MR cache.
struct Device {
  DeviceChoice choice;
  Owned<ibv_context> context;
  Owned<ibv_pd> pd;
  ibv_port_attr port{};
  ibv_gid gid{};
  uint32_t maxInline = 0;
  uint32_t maxMessage = 0;
  std::unique_ptr<MrCache> cache;
  static std::shared_ptr<Device> open();
};

// What two ranks exchange through the store to connect their queue pairs.
struct ConnInfo {
  uint64_t magic = 0;
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  uint8_t roce = 0;
  uint8_t mtu = 0;
  uint8_t gid[16] = {0};
};

class RdmaPair : public Pair, public std::enable_shared_from_this<RdmaPair> {
 public:
  RdmaPair(std::shared_ptr<Device> device, int peer, Inbox* inbox, Config config);
  ~RdmaPair() override;
  int peer() const override { return peer_; }
  const char* transportName() const override { return "rdma"; }
  void send(const Envelope& envelope, const void* data, MemoryKind memory,
            SendDone done) override;
  void close() override;

  ConnInfo localInfo() const;
  void connectTo(const ConnInfo& remote);  // INIT -> RTR -> RTS; throws TransportError
  void startProgress();  // the progress thread holds the pair until it exits (Transport.h)

 private:
  enum Kind : uint32_t { kEager = 1, kRts = 2, kCts = 3, kKeepalive = 4, kGoodbye = 5 };
  enum CtsStatus : int32_t { kCtsOk = 0, kCtsDrop = 1 };  // > 1: the receiver's errno
  struct Ctrl {
    uint32_t kind = 0;
    int32_t status = 0;
    Envelope envelope;
    uint64_t id = 0;
    uint64_t address = 0;
    uint32_t rkey = 0;
    uint32_t pad = 0;
  };
  // A send waiting for a slot / send-queue room, in send() order.
  struct Pending {
    Ctrl ctrl;
    const void* data = nullptr;   // EAGER payload or the RDMA write source
    SendDone done;                // EAGER: the user's; kept for WRITE
    bool write = false;
    RegistrationRef reg;          // WRITE: the source's registration
  };
  // A work request the NIC has not completed yet.
  struct InFlight {
    int slot = -1;     // send slot to free
    int retire = 1;    // WRs this completion retires (unsignaled chunks before it)
    const char* op = "send";
    SendDone done;
    RegistrationRef reg;
  };
  struct LargeSend {
    const void* data = nullptr;
    uint64_t nbytes = 0;
    SendDone done;
  };
  struct LargeRecv {
    Landing landing;
    RegistrationRef reg;
  };
  using Deferred = std::vector<std::function<void()>>;

  static constexpr uint64_t kRecvBit = 1ull << 63;

  void postRecv(int slot);                              // throws TransportError
  bool tryPost(Pending& p, Deferred& deferred);         // under mu_; throws TransportError
  void drainBacklog(Deferred& deferred);                // under mu_
  void enqueue(Pending p, Deferred& deferred);          // under mu_
  void progressLoop();
  void handle(const ibv_wc& wc, Deferred& deferred);
  // A receive completion: checks the header, reposts the slot and hands the message to the
  // handler of its kind (below).
  void handleRecv(const ibv_wc& wc, Deferred& deferred);
  void repost(int slot, Deferred& deferred);
  void receiveWriteDone(uint32_t id, Deferred& deferred);  // a rendezvous write landed
  void receiveEager(const Ctrl& c, int slot, size_t payloadBytes, Deferred& deferred);
  void receiveRts(const Ctrl& rts);
  void receiveCts(const Ctrl& c, Deferred& deferred);
  // After CTS: register the payload and write it into the receiver's buffer (under mu_).
  void writeRendezvous(const Ctrl& cts, LargeSend out, Deferred& deferred);
  void handleSendCompletion(const ibv_wc& wc, Deferred& deferred);
  // A receive matched an announced (RTS) message: register its buffer and answer CTS.
  void answerRts(const Ctrl& rts, Landing landing, Deferred& deferred);
  void fail(const std::string& cause);
  // fail(cause) once the completions being handled are done (outside the pair's lock).
  void failLater(Deferred& deferred, std::string cause);
  // "rdma: protocol error: rank <peer> <what>".
  std::string protocolError(const std::string& what) const;
  std::exception_ptr error(const std::string& what) const;
  // Every pending completion, taken out of the pair (under mu_) to be failed outside the lock.
  struct Orphans {
    std::deque<Pending> backlog;
    std::map<uint64_t, InFlight> inFlight;
    std::map<uint64_t, LargeSend> largeSends;
    std::map<uint32_t, LargeRecv> largeRecvs;
    void failAll(const std::exception_ptr& error);
  };
  Orphans takePendingLocked();
  char* sendSlot(int i) const { return sendBuf_.get() + static_cast<size_t>(i) * slotBytes_; }
  char* recvSlot(int i) const { return recvBuf_.get() + static_cast<size_t>(i) * slotBytes_; }

  std::shared_ptr<Device> device_;
  const int peer_;
  Inbox* inbox_;
  const Config config_;
  const size_t slotBytes_;
  uint32_t psn_ = 0;

  Owned<ibv_comp_channel> channel_;
  Owned<ibv_cq> cq_;
  Owned<ibv_qp> qp_;
  std::unique_ptr<char[]> sendBuf_, recvBuf_;
  Owned<ibv_mr> sendMr_, recvMr_;
  int sqDepth_ = 0;
  FailureLatch latch_;  // under mu_

  std::mutex mu_;
  std::vector<int> freeSlots_;
  std::deque<Pending> backlog_;
  std::map<uint64_t, InFlight> inFlight_;
  std::map<uint64_t, LargeSend> largeSends_;
  std::map<uint32_t, LargeRecv> largeRecvs_;
  uint64_t nextWr_ = 1;
  uint32_t nextLargeId_ = 1;
  int sqUsed_ = 0;
  std::chrono::steady_clock::time_point lastPost_;

  std::atomic<bool> stop_{false};
  std::thread progress_;
};

class RdmaTransport : public Transport {
 public:
  std::string name() const override { return "rdma"; }
  void start(const TransportContext& context) override;
  std::shared_ptr<Pair> connect(int peer) override;

 private:
  std::string key(const char* what, int from, int to) const;
  TransportContext ctx_;
  Config config_;
  std::shared_ptr<Device> device_;
};

}  // namespace rdma
}  // namespace dicomm
