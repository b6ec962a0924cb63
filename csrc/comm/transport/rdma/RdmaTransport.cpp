#include "comm/transport/rdma/RdmaTransport.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/transport/Log.h"
#include "comm/transport/Env.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <system_error>

namespace dicomm {
namespace rdma {

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kConnMagic = 0x31616d6472694444ULL;  // "DDirdma1"
// Every registration allows remote writes: one MR serves both directions and the rkey is only
// ever given to the connected peer of this group.
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;

}  // namespace

Config Config::fromEnv() {
  Config c;
  c.eagerMax = static_cast<size_t>(envLong("DICOMM_RDMA_EAGER", c.eagerMax, 0, 1 << 20));
  c.sendSlots = static_cast<int>(envLong("DICOMM_RDMA_SEND_SLOTS", c.sendSlots, 2, 4096));
  c.recvSlots = static_cast<int>(envLong("DICOMM_RDMA_RECV_SLOTS", c.recvSlots, 2, 16384));
  c.keepaliveMs = static_cast<int>(envLong("DICOMM_RDMA_KEEPALIVE_MS", c.keepaliveMs, 10, 600000));
  c.spinUs = static_cast<int>(envLong("DICOMM_RDMA_SPIN_US", c.spinUs, 0, 1000000));
  c.timeoutExponent = static_cast<int>(envLong("DICOMM_RDMA_TIMEOUT_EXP", c.timeoutExponent, 8, 31));
  return c;
}

// ---- Device -------------------------------------------------------------------------------

std::shared_ptr<Device> Device::open() {
  auto d = std::make_shared<Device>();
  d->choice = chooseDevice();
  d->context = openDevice(d->choice);
  ibv_pd* pd = ibv_alloc_pd(d->context.get());
  if (!pd) throw std::runtime_error("rdma: ibv_alloc_pd on " + d->choice.name + " failed: " + strerror(errno));
  d->pd.reset(pd);
  if (ibv_query_port(d->context.get(), static_cast<uint8_t>(d->choice.port), &d->port)) {
    throw std::runtime_error("rdma: ibv_query_port " + d->choice.name + ":" +
                             std::to_string(d->choice.port) + " failed: " + strerror(errno));
  }
  if (d->choice.gidIndex >= 0 &&
      ibv_query_gid(d->context.get(), static_cast<uint8_t>(d->choice.port), d->choice.gidIndex, &d->gid)) {
    throw std::runtime_error("rdma: ibv_query_gid " + d->choice.name + " index " +
                             std::to_string(d->choice.gidIndex) + " failed: " + strerror(errno));
  }
  d->maxMessage = d->port.max_msg_sz ? d->port.max_msg_sz : (1u << 30);
  d->cache = std::make_unique<MrCache>(pd);
  return d;
}

// ---- RdmaPair: set-up ----------------------------------------------------------------------

RdmaPair::RdmaPair(std::shared_ptr<Device> device, int peer, Inbox* inbox, Config config)
    : device_(std::move(device)), peer_(peer), inbox_(inbox), config_(config),
      slotBytes_((sizeof(Ctrl) + config.eagerMax + 63) & ~size_t(63)), latch_("rdma", peer) {
  auto fatal = [&](const char* op) {
    throw TransportError(peer_, callError(op, peer_, errno ? errno : EINVAL));
  };
  ibv_context* ctx = device_->context.get();
  ibv_comp_channel* ch = ibv_create_comp_channel(ctx);
  if (!ch) fatal("ibv_create_comp_channel");
  channel_.reset(ch);
  int flags = fcntl(ch->fd, F_GETFL);
  fcntl(ch->fd, F_SETFL, flags | O_NONBLOCK);
  // Writes are chunked so one message never needs more than 64 work requests.
  sqDepth_ = config_.sendSlots + 64 + 8;
  ibv_cq* cq = ibv_create_cq(ctx, sqDepth_ + config_.recvSlots + 16, this, ch, 0);
  if (!cq) fatal("ibv_create_cq");
  cq_.reset(cq);

  ibv_qp_init_attr init{};
  init.send_cq = cq;
  init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = static_cast<uint32_t>(sqDepth_);
  init.cap.max_recv_wr = static_cast<uint32_t>(config_.recvSlots);
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = 256;
  ibv_qp* qp = ibv_create_qp(device_->pd.get(), &init);
  if (!qp) {
    init.cap.max_inline_data = 0;  // some devices allow no inline data
    qp = ibv_create_qp(device_->pd.get(), &init);
  }
  if (!qp) fatal("ibv_create_qp");
  qp_.reset(qp);
  device_->maxInline = init.cap.max_inline_data;

  const size_t sendBytes = slotBytes_ * static_cast<size_t>(config_.sendSlots);
  const size_t recvBytes = slotBytes_ * static_cast<size_t>(config_.recvSlots);
  sendBuf_.reset(new char[sendBytes]);
  recvBuf_.reset(new char[recvBytes]);
  ibv_mr* smr = ibv_reg_mr(device_->pd.get(), sendBuf_.get(), sendBytes, IBV_ACCESS_LOCAL_WRITE);
  if (!smr) fatal("ibv_reg_mr (send bounce buffers)");
  sendMr_.reset(smr);
  ibv_mr* rmr = ibv_reg_mr(device_->pd.get(), recvBuf_.get(), recvBytes, IBV_ACCESS_LOCAL_WRITE);
  if (!rmr) fatal("ibv_reg_mr (receive bounce buffers)");
  recvMr_.reset(rmr);
  for (int i = config_.sendSlots - 1; i >= 0; --i) freeSlots_.push_back(i);

  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = static_cast<uint8_t>(device_->choice.port);
  a.qp_access_flags = kAccess;
  if (int err = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
    throw TransportError(peer_, callError("ibv_modify_qp(INIT)", peer_, err));
  }
  // Receives are posted before the peer can send (it waits for our RTR in the store).
  for (int i = 0; i < config_.recvSlots; ++i) postRecv(i);
  std::random_device rd;
  psn_ = rd() & 0xffffff;
  lastPost_ = Clock::now();
}

RdmaPair::~RdmaPair() {
  close();
  if (progress_.joinable()) {
    // On the progress thread itself only as its last act, once its loop has ended (it holds
    // the pair until then): nothing uses the verbs objects any more.
    if (progress_.get_id() == std::this_thread::get_id()) {
      progress_.detach();
    } else {
      progress_.join();
    }
  }
  // Order matters: the QP before its CQ, the CQ before its channel, MRs before the PD.
  qp_.reset();
  cq_.reset();
  channel_.reset();
  sendMr_.reset();
  recvMr_.reset();
}

ConnInfo RdmaPair::localInfo() const {
  ConnInfo info;
  info.magic = kConnMagic;
  info.qpn = qp_->qp_num;
  info.psn = psn_;
  info.lid = device_->port.lid;
  info.roce = device_->choice.roce ? 1 : 0;
  info.mtu = static_cast<uint8_t>(device_->port.active_mtu);
  memcpy(info.gid, device_->gid.raw, sizeof(info.gid));
  return info;
}

void RdmaPair::connectTo(const ConnInfo& remote) {
  if (remote.magic != kConnMagic) {
    throw TransportError(peer_, "rdma: rank " + std::to_string(peer_) +
                                    " published malformed queue-pair data");
  }
  if (remote.roce != (device_->choice.roce ? 1 : 0)) {
    throw TransportError(peer_, "rdma: link layers differ: this rank uses " +
                                    std::string(device_->choice.roce ? "RoCE" : "InfiniBand") +
                                    ", rank " + std::to_string(peer_) + " the other");
  }
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(std::min<int>(remote.mtu, device_->port.active_mtu));
  a.dest_qp_num = remote.qpn;
  a.rq_psn = remote.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 1;  // 0.01 ms: a busy receiver reposts quickly
  a.ah_attr.port_num = static_cast<uint8_t>(device_->choice.port);
  a.ah_attr.dlid = remote.lid;
  if (device_->choice.roce) {
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, remote.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(device_->choice.gidIndex);
    a.ah_attr.grh.hop_limit = 64;
  }
  int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  if (int err = ibv_modify_qp(qp_.get(), &a, mask)) {
    throw TransportError(peer_, callError("ibv_modify_qp(RTR)", peer_, err));
  }
  ibv_qp_attr s{};
  s.qp_state = IBV_QPS_RTS;
  s.timeout = static_cast<uint8_t>(config_.timeoutExponent);
  s.retry_cnt = 6;  // not 7: rxe (like the spec for rnr_retry) treats 7 as "retry forever"
  s.rnr_retry = 7;  // infinite: a receiver that is slow to repost is not an error
  s.sq_psn = psn_;
  s.max_rd_atomic = 1;
  mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
         IBV_QP_MAX_QP_RD_ATOMIC;
  if (int err = ibv_modify_qp(qp_.get(), &s, mask)) {
    throw TransportError(peer_, callError("ibv_modify_qp(RTS)", peer_, err));
  }
}

void RdmaPair::startProgress() {
  if (int err = ibv_req_notify_cq(cq_.get(), 0)) {
    throw TransportError(peer_, callError("ibv_req_notify_cq", peer_, err));
  }
  progress_ = std::thread([self = shared_from_this()] { self->progressLoop(); });
}

void RdmaPair::postRecv(int slot) {
  ibv_sge sge{reinterpret_cast<uint64_t>(recvSlot(slot)), static_cast<uint32_t>(slotBytes_),
              recvMr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = kRecvBit | static_cast<uint64_t>(slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (int err = ibv_post_recv(qp_.get(), &wr, &bad)) {
    throw TransportError(peer_, callError("ibv_post_recv", peer_, err));
  }
}

std::exception_ptr RdmaPair::error(const std::string& what) const {
  return std::make_exception_ptr(TransportError(peer_, what));
}

// ---- sending ------------------------------------------------------------------------------

void RdmaPair::send(const Envelope& envelope, const void* data, MemoryKind memory,
                    SendDone done) {
  if (memory != MemoryKind::kHost) {
    done(error("rdma: device memory that the host cannot address is not registered by this "
               "transport (canAccessDevice() is false); the core must stage it"));
    return;
  }
  Deferred deferred;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!latch_.up()) {
      auto err = latch_.error();
      deferred.push_back([done = std::move(done), err] { done(err); });
    } else {
      Pending p;
      p.ctrl.envelope = envelope;
      if (envelope.nbytes <= config_.eagerMax) {
        p.ctrl.kind = kEager;
        p.data = data;
        p.done = std::move(done);
      } else {
        // Rendezvous: announce now, write when the receiver says where (CTS).
        p.ctrl.kind = kRts;
        p.ctrl.id = nextLargeId_++;
        largeSends_[p.ctrl.id] = LargeSend{data, envelope.nbytes, std::move(done)};
      }
      try {
        enqueue(std::move(p), deferred);
      } catch (const std::exception& e) {
        failLater(deferred, e.what());
      }
    }
  }
  for (auto& f : deferred) f();
}

void RdmaPair::enqueue(Pending p, Deferred& deferred) {
  if (backlog_.empty()) {
    try {
      if (tryPost(p, deferred)) return;
    } catch (...) {
      backlog_.push_back(std::move(p));  // fail() completes it with the error
      throw;
    }
  }
  backlog_.push_back(std::move(p));
}

void RdmaPair::drainBacklog(Deferred& deferred) {
  while (!backlog_.empty() && !latch_.failed() && tryPost(backlog_.front(), deferred)) backlog_.pop_front();
}

bool RdmaPair::tryPost(Pending& p, Deferred& deferred) {
  ibv_send_wr* bad = nullptr;
  if (p.write) {
    const size_t n = p.ctrl.envelope.nbytes;
    size_t chunk = std::max(config_.writeChunk, (n + 63) / 64);
    chunk = std::min<size_t>(chunk, device_->maxMessage ? device_->maxMessage : chunk);
    const int wrs = static_cast<int>((n + chunk - 1) / chunk);
    if (sqUsed_ + wrs > sqDepth_) return false;
    std::vector<ibv_sge> sges(static_cast<size_t>(wrs));
    std::vector<ibv_send_wr> list(static_cast<size_t>(wrs));
    const uint64_t id = nextWr_++;
    for (int i = 0; i < wrs; ++i) {
      const size_t off = static_cast<size_t>(i) * chunk;
      const size_t len = std::min(chunk, n - off);
      sges[i] = ibv_sge{reinterpret_cast<uint64_t>(p.data) + off, static_cast<uint32_t>(len),
                        p.reg->lkey()};
      ibv_send_wr& wr = list[i];
      wr = ibv_send_wr{};
      wr.sg_list = &sges[i];
      wr.num_sge = 1;
      wr.wr.rdma.remote_addr = p.ctrl.address + off;
      wr.wr.rdma.rkey = p.ctrl.rkey;
      if (i + 1 < wrs) {
        wr.opcode = IBV_WR_RDMA_WRITE;  // unsignaled: RC completes them in order before the last
        wr.next = &list[i + 1];
      } else {
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.imm_data = htonl(static_cast<uint32_t>(p.ctrl.id));
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.wr_id = id;
      }
    }
    if (int err = ibv_post_send(qp_.get(), list.data(), &bad)) {
      const long at = bad ? static_cast<long>(bad - list.data()) : -1;
      throw TransportError(peer_, callError("ibv_post_send(RDMA write)", peer_, err) +
                                      " at work request " + std::to_string(at) + " of " +
                                      std::to_string(wrs) + " for " + std::to_string(n) +
                                      " bytes (send queue " + std::to_string(sqUsed_) + "/" +
                                      std::to_string(sqDepth_) + ")");
    }
    InFlight f;
    f.retire = wrs;
    f.op = "RDMA write";
    f.done = std::move(p.done);
    f.reg = std::move(p.reg);
    inFlight_[id] = std::move(f);
    sqUsed_ += wrs;
    lastPost_ = Clock::now();
    return true;
  }
  if (freeSlots_.empty() || sqUsed_ + 1 > sqDepth_) return false;
  const int slot = freeSlots_.back();
  freeSlots_.pop_back();
  char* buf = sendSlot(slot);
  memcpy(buf, &p.ctrl, sizeof(Ctrl));
  size_t bytes = sizeof(Ctrl);
  if (p.ctrl.kind == kEager && p.ctrl.envelope.nbytes > 0) {
    memcpy(buf + sizeof(Ctrl), p.data, p.ctrl.envelope.nbytes);
    bytes += p.ctrl.envelope.nbytes;
  }
  ibv_sge sge{reinterpret_cast<uint64_t>(buf), static_cast<uint32_t>(bytes), sendMr_->lkey};
  ibv_send_wr wr{};
  const uint64_t id = nextWr_++;
  wr.wr_id = id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED | (bytes <= device_->maxInline ? IBV_SEND_INLINE : 0);
  if (int err = ibv_post_send(qp_.get(), &wr, &bad)) {
    freeSlots_.push_back(slot);
    throw TransportError(peer_, callError("ibv_post_send(SEND)", peer_, err));
  }
  InFlight f;
  f.slot = slot;
  f.op = p.ctrl.kind == kEager ? "send" : p.ctrl.kind == kRts ? "rendezvous request"
        : p.ctrl.kind == kCts ? "rendezvous reply" : p.ctrl.kind == kKeepalive ? "keepalive" : "goodbye";
  inFlight_[id] = std::move(f);
  ++sqUsed_;
  lastPost_ = Clock::now();
  // The payload is in the bounce slot: the caller's buffer is free now.
  if (p.done) deferred.push_back([done = std::move(p.done)] { done(nullptr); });
  return true;
}

// ---- progress -----------------------------------------------------------------------------

void RdmaPair::failLater(Deferred& deferred, std::string cause) {
  deferred.push_back([this, cause = std::move(cause)] { fail(cause); });
}

std::string RdmaPair::protocolError(const std::string& what) const {
  return "rdma: protocol error: rank " + std::to_string(peer_) + " " + what;
}

void RdmaPair::progressLoop() {
  ibv_wc wcs[32];
  unsigned unacked = 0;
  auto drain = [&](Deferred& deferred) {
    int n;
    int total = 0;
    while ((n = ibv_poll_cq(cq_.get(), 32, wcs)) > 0) {
      for (int i = 0; i < n; ++i) handle(wcs[i], deferred);
      total += n;
    }
    if (n < 0) fail(callError("ibv_poll_cq", peer_, EIO));
    return total;
  };
  while (!stop_.load()) {
    pollfd pfd{channel_->fd, POLLIN, 0};
    int r = ::poll(&pfd, 1, std::min(config_.keepaliveMs, 100));
    if (stop_.load()) break;
    if (r > 0) {
      ibv_cq* cq = nullptr;
      void* cqContext = nullptr;
      while (ibv_get_cq_event(channel_.get(), &cq, &cqContext) == 0) ++unacked;
      if (unacked >= 64) {
        ibv_ack_cq_events(cq_.get(), unacked);
        unacked = 0;
      }
      if (ibv_req_notify_cq(cq_.get(), 0)) fail(callError("ibv_req_notify_cq", peer_, EIO));
    }
    // Drain, then keep polling for a short while: back-to-back messages skip the sleep.
    auto spinUntil = Clock::now() + std::chrono::microseconds(config_.spinUs);
    do {
      Deferred deferred;
      int got = drain(deferred);
      for (auto& f : deferred) f();
      if (got > 0) spinUntil = Clock::now() + std::chrono::microseconds(config_.spinUs);
    } while (!stop_.load() && Clock::now() < spinUntil);

    // Keepalive: an idle pair sends a tiny message, so a dead peer shows up as a failed send.
    Deferred deferred;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (latch_.up() && backlog_.empty() &&
          Clock::now() - lastPost_ >= std::chrono::milliseconds(config_.keepaliveMs)) {
        Pending p;
        p.ctrl.kind = kKeepalive;
        try {
          tryPost(p, deferred);
        } catch (const std::exception& e) {
          failLater(deferred, e.what());
        }
      }
    }
    for (auto& f : deferred) f();
  }
  if (unacked) ibv_ack_cq_events(cq_.get(), unacked);
}

void RdmaPair::handle(const ibv_wc& wc, Deferred& deferred) {
  // Whatever a completion throws (a malformed message the core refuses, an allocation that
  // fails) fails this pair with a cause naming the peer; it never escapes the progress thread.
  try {
    if (wc.wr_id & kRecvBit) {
      handleRecv(wc, deferred);
    } else {
      handleSendCompletion(wc, deferred);
    }
  } catch (const std::exception& e) {
    failLater(deferred, e.what());
  }
}

void RdmaPair::handleSendCompletion(const ibv_wc& wc, Deferred& deferred) {
  InFlight f;
  bool known = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = inFlight_.find(wc.wr_id);
    if (it != inFlight_.end()) {
      f = std::move(it->second);
      inFlight_.erase(it);
      known = true;
      sqUsed_ -= f.retire;
      if (f.slot >= 0) freeSlots_.push_back(f.slot);
    }
    if (wc.status == IBV_WC_SUCCESS && latch_.up()) {
      try {
        drainBacklog(deferred);
      } catch (const std::exception& e) {
        failLater(deferred, e.what());
      }
    }
  }
  if (!known) return;  // already failed by fail()/close()
  if (wc.status != IBV_WC_SUCCESS) {
    // The op's own error names the root cause too, as the pair's failure will.
    std::string cause = latch_.rootCause(*inbox_, wcError(f.op, "to", peer_, wc));
    if (f.done) deferred.push_back([done = std::move(f.done), e = error(cause)] { done(e); });
    failLater(deferred, cause);
    return;
  }
  if (f.done) deferred.push_back([done = std::move(f.done)] { done(nullptr); });
}

void RdmaPair::handleRecv(const ibv_wc& wc, Deferred& deferred) {
  const int slot = static_cast<int>(wc.wr_id & ~kRecvBit);
  if (wc.status != IBV_WC_SUCCESS) {
    bool quiet;
    {
      std::lock_guard<std::mutex> lock(mu_);
      quiet = !latch_.up();
    }
    if (!quiet || wc.status != IBV_WC_WR_FLUSH_ERR) {
      failLater(deferred, wcError("receive", "from", peer_, wc));
    }
    return;
  }
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    repost(slot, deferred);
    receiveWriteDone(ntohl(wc.imm_data), deferred);
    return;
  }
  if (wc.byte_len < sizeof(Ctrl)) {
    repost(slot, deferred);
    failLater(deferred, protocolError("sent a " + std::to_string(wc.byte_len) +
                                      "-byte message, shorter than a header"));
    return;
  }
  Ctrl c;
  memcpy(&c, recvSlot(slot), sizeof(c));
  switch (c.kind) {
    case kEager:
      receiveEager(c, slot, wc.byte_len - sizeof(Ctrl), deferred);  // reposts the slot itself
      return;
    case kRts:
      repost(slot, deferred);
      receiveRts(c);
      return;
    case kCts:
      repost(slot, deferred);
      receiveCts(c, deferred);
      return;
    case kKeepalive:
      repost(slot, deferred);
      return;
    case kGoodbye:
      repost(slot, deferred);
      failLater(deferred, "rdma: rank " + std::to_string(peer_) + " shut down its process group");
      return;
    default:
      repost(slot, deferred);
      failLater(deferred, protocolError("sent a message of unknown kind " + std::to_string(c.kind)));
  }
}

void RdmaPair::repost(int slot, Deferred& deferred) {
  try {
    postRecv(slot);
  } catch (const std::exception& e) {
    failLater(deferred, e.what());
  }
}

void RdmaPair::receiveWriteDone(uint32_t id, Deferred& deferred) {
  // The last chunk of a rendezvous write landed; RC ordering means all of it did.
  LargeRecv in;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = largeRecvs_.find(id);
    if (it == largeRecvs_.end()) {
      failLater(deferred, protocolError("wrote transfer " + std::to_string(id) +
                                        ", which this rank never asked for"));
      return;
    }
    in = std::move(it->second);
    largeRecvs_.erase(it);
  }
  if (in.landing.done) deferred.push_back([done = std::move(in.landing.done)] { done(nullptr); });
}

void RdmaPair::receiveEager(const Ctrl& c, int slot, size_t payloadBytes, Deferred& deferred) {
  const Envelope& env = c.envelope;
  // Compared without adding to the peer's size, which could wrap.
  if (env.nbytes > config_.eagerMax || payloadBytes != env.nbytes) {
    repost(slot, deferred);
    failLater(deferred, protocolError("sent " + std::to_string(payloadBytes + sizeof(Ctrl)) +
                                      " bytes for an eager message of " +
                                      std::to_string(env.nbytes)));
    return;
  }
  Landing landing = inbox_->arrive(peer_, env);
  if (landing.data != nullptr && landing.capacity >= env.nbytes && env.nbytes > 0) {
    memcpy(landing.data, recvSlot(slot) + sizeof(Ctrl), env.nbytes);
  }
  repost(slot, deferred);  // only once the payload is out of the slot
  if (landing.done) deferred.push_back([done = std::move(landing.done)] { done(nullptr); });
}

void RdmaPair::receiveRts(const Ctrl& rts) {
  // The write waits on the sender until a receive matches, so it lands in the user's buffer
  // even when the receive is posted after the message arrived (no bounce copy).
  inbox_->arriveWhenPosted(peer_, rts.envelope, [this, rts](Landing landing) {
    Deferred later;
    answerRts(rts, std::move(landing), later);
    for (auto& f : later) f();
  });
}

void RdmaPair::receiveCts(const Ctrl& c, Deferred& deferred) {
  // Under mu_ throughout: a failure meanwhile must find the send either here or queued.
  std::lock_guard<std::mutex> lock(mu_);
  auto it = largeSends_.find(c.id);
  if (it == largeSends_.end()) {
    if (latch_.up()) {
      failLater(deferred, protocolError("answered transfer " + std::to_string(c.id) +
                                        ", which this rank never announced"));
    }
    return;
  }
  LargeSend out = std::move(it->second);
  largeSends_.erase(it);
  if (c.status == kCtsDrop) {
    deferred.push_back([done = std::move(out.done)] { done(nullptr); });
    return;
  }
  std::string refused;
  if (c.status != kCtsOk) {
    refused = "rdma: rank " + std::to_string(peer_) + " could not register its receive buffer: " +
              strerror(c.status);
  } else if (c.envelope.nbytes != out.nbytes) {
    refused = protocolError("answered transfer " + std::to_string(c.id) + " for " +
                            std::to_string(c.envelope.nbytes) + " bytes, this rank announced " +
                            std::to_string(out.nbytes));
  }
  if (!refused.empty()) {
    deferred.push_back([done = std::move(out.done), e = error(refused)] { done(e); });
    return;
  }
  writeRendezvous(c, std::move(out), deferred);
}

void RdmaPair::writeRendezvous(const Ctrl& cts, LargeSend out, Deferred& deferred) {
  Pending w;
  w.write = true;
  w.ctrl = cts;
  w.data = out.data;
  w.done = std::move(out.done);
  try {
    w.reg = device_->cache->get(out.data, out.nbytes, kAccess);
  } catch (const std::system_error& e) {
    std::string cause = "rdma: ibv_reg_mr of the " + std::to_string(out.nbytes) +
                        "-byte send buffer for rank " + std::to_string(peer_) +
                        " failed: " + strerror(e.code().value());
    // The receiver waits for this write; nothing can complete it now.
    deferred.push_back([done = std::move(w.done), e = error(cause)] { done(e); });
    failLater(deferred, cause);
    return;
  }
  try {
    enqueue(std::move(w), deferred);
  } catch (const std::exception& e) {
    failLater(deferred, e.what());
  }
}

void RdmaPair::answerRts(const Ctrl& rts, Landing landing, Deferred& deferred) {
  const Envelope& env = rts.envelope;
  Pending reply;
  reply.ctrl.kind = kCts;
  reply.ctrl.id = rts.id;
  reply.ctrl.envelope = env;
  RegistrationRef reg;
  if (landing.data == nullptr || landing.capacity < env.nbytes) {
    reply.ctrl.status = kCtsDrop;  // the core rejected it; the sender's data is not needed
    if (landing.done) deferred.push_back([done = std::move(landing.done)] { done(nullptr); });
  } else {
    try {
      reg = device_->cache->get(landing.data, env.nbytes, kAccess);
      reply.ctrl.address = reinterpret_cast<uint64_t>(landing.data);
      reply.ctrl.rkey = reg->rkey();
#ifdef DICOMM_TEST_HOOKS
      // Only in tests/comm_rdma's transport_check build: publishes a wrong key on request, so
      // the pyverbs oracle (verbs_oracle.py) is shown to catch one.
      reply.ctrl.rkey ^= static_cast<uint32_t>(envLong("DICOMM_TEST_RKEY_XOR", 0, 0, 0xffffffffL));
#endif
    } catch (const std::system_error& e) {
      reply.ctrl.status = e.code().value() > 1 ? e.code().value() : EINVAL;
      std::string cause = "rdma: ibv_reg_mr of the " + std::to_string(env.nbytes) +
                          "-byte receive buffer for rank " + std::to_string(peer_) +
                          " failed: " + strerror(reply.ctrl.status);
      if (landing.done) deferred.push_back([done = std::move(landing.done), e = error(cause)] { done(e); });
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!latch_.up()) {
    // fail()/close() already swept the pending transfers: complete this one here.
    if (landing.done) {
      auto e = latch_.error();
      deferred.push_back([done = std::move(landing.done), e] { done(e); });
    }
    return;
  }
  if (reply.ctrl.status == kCtsOk) {
    const auto id = static_cast<uint32_t>(rts.id);
    if (largeRecvs_.count(id)) {
      // A second announcement under a live transfer's id would orphan the first landing.
      const std::string cause = protocolError("announced transfer " + std::to_string(id) + " twice");
      if (landing.done) deferred.push_back([done = std::move(landing.done), e = error(cause)] { done(e); });
      failLater(deferred, cause);
      return;
    }
    largeRecvs_[id] = LargeRecv{std::move(landing), std::move(reg)};
  }
  try {
    enqueue(std::move(reply), deferred);
  } catch (const std::exception& e) {
    failLater(deferred, e.what());
  }
}

// ---- failure and shutdown -----------------------------------------------------------------

void RdmaPair::fail(const std::string& lost) {
  {
    // Closed (maybe from a callback on the progress thread, its inbox gone since): nothing to say.
    std::lock_guard<std::mutex> lock(mu_);
    if (!latch_.up()) return;
  }
  const std::string cause = latch_.rootCause(*inbox_, lost);
  Orphans orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!latch_.fail(cause)) return;
    orphans = takePendingLocked();
    // Stop the NIC touching user buffers before their owners hear about the failure.
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(qp_.get(), &a, IBV_QP_STATE);
  }
  orphans.failAll(latch_.error());
  inbox_->peerFailed(peer_, cause);
}

RdmaPair::Orphans RdmaPair::takePendingLocked() {
  Orphans o;
  o.backlog.swap(backlog_);
  o.inFlight.swap(inFlight_);
  o.largeSends.swap(largeSends_);
  o.largeRecvs.swap(largeRecvs_);
  return o;
}

void RdmaPair::Orphans::failAll(const std::exception_ptr& error) {
  for (auto& p : backlog) {
    if (p.done) p.done(error);
  }
  for (auto& kv : inFlight) {
    if (kv.second.done) kv.second.done(error);
  }
  for (auto& kv : largeSends) {
    if (kv.second.done) kv.second.done(error);
  }
  for (auto& kv : largeRecvs) {
    if (kv.second.landing.done) kv.second.landing.done(error);
  }
}

void RdmaPair::close() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (latch_.closing()) return;
    if (!latch_.failed() && qp_ && progress_.joinable()) {
      // Let what was already sent leave, then say goodbye (both bounded).
      auto until = Clock::now() + std::chrono::seconds(2);
      while ((!backlog_.empty() || !inFlight_.empty()) && !latch_.failed() && Clock::now() < until) {
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        lock.lock();
      }
      if (!latch_.failed() && backlog_.empty()) {
        Pending bye;
        bye.ctrl.kind = kGoodbye;
        Deferred ignored;
        try {
          if (tryPost(bye, ignored)) {
            auto byeUntil = Clock::now() + std::chrono::milliseconds(500);
            while (!inFlight_.empty() && !latch_.failed() && Clock::now() < byeUntil) {
              lock.unlock();
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
              lock.lock();
            }
          }
        } catch (const std::exception&) {
        }
      }
    }
    latch_.close();
    if (qp_) {
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_ERR;
      ibv_modify_qp(qp_.get(), &a, IBV_QP_STATE);
    }
  }
  stop_.store(true);
  // Closed from a completion callback: the loop sees stop_ and exits; the destructor joins.
  if (progress_.joinable() && progress_.get_id() != std::this_thread::get_id()) progress_.join();
  Orphans orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    orphans = takePendingLocked();
  }
  orphans.failAll(latch_.error());
}

// ---- RdmaTransport ------------------------------------------------------------------------

std::string RdmaTransport::key(const char* what, int from, int to) const {
  return ctx_.keyPrefix + "rdma/" + what + "/" + std::to_string(from) + "/" + std::to_string(to);
}

void RdmaTransport::start(const TransportContext& context) {
  ctx_ = context;
  config_ = Config::fromEnv();
  device_ = Device::open();
  trackCpuAllocations();
}

std::shared_ptr<Pair> RdmaTransport::connect(int peer) {
  auto pair = std::make_shared<RdmaPair>(device_, peer, ctx_.inbox, config_);
  ConnInfo mine = pair->localInfo();
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&mine);
  ctx_.store->set(key("qp", ctx_.rank, peer), std::vector<uint8_t>(b, b + sizeof(mine)));
  auto waitFor = [&](const std::string& k, const char* what) {
    try {
      ctx_.store->wait({k}, ctx_.timeout);
    } catch (const std::exception&) {
      throw TransportError(peer, "dicomm rdma: rank " + std::to_string(peer) + " did not " +
                                     what + " within " + std::to_string(ctx_.timeout.count()) +
                                     " ms (did it join the process group?)");
    }
  };
  waitFor(key("qp", peer, ctx_.rank), "publish its queue pair");
  auto bytes = ctx_.store->get(key("qp", peer, ctx_.rank));
  if (bytes.size() != sizeof(ConnInfo)) {
    throw TransportError(peer, "dicomm rdma: rank " + std::to_string(peer) +
                                   " published " + std::to_string(bytes.size()) +
                                   " bytes of queue-pair data, expected " +
                                   std::to_string(sizeof(ConnInfo)) + " (mixed ditorch versions?)");
  }
  ConnInfo theirs;
  memcpy(&theirs, bytes.data(), sizeof(theirs));
  pair->connectTo(theirs);
  // Neither side sends before both queue pairs can receive.
  ctx_.store->set(key("ready", ctx_.rank, peer), std::vector<uint8_t>{1});
  waitFor(key("ready", peer, ctx_.rank), "bring its queue pair up");
  pair->startProgress();
  return pair;
}

namespace {

bool rdmaUsable() {
  std::string why = unusableReason();
  if (why.empty()) return true;
  static std::once_flag once;
  std::call_once(once, [&] {
    logLine(LogLevel::kInfo, "rdma transport not usable (" + why + "); peers use tcp/shm instead");
  });
  return false;
}

TransportFactory rdmaFactory() {
  TransportFactory f;
  f.usable = rdmaUsable;
  f.reaches = [](const std::string&, const std::string&) { return true; };
  f.create = [] { return std::unique_ptr<Transport>(new RdmaTransport()); };
  f.preference = 10;
  return f;
}

}  // namespace
}  // namespace rdma
}  // namespace dicomm

DICOMM_REGISTER_TRANSPORT(rdma, ::dicomm::rdma::rdmaFactory());
