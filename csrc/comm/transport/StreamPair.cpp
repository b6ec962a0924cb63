#include "comm/transport/StreamPair.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "comm/transport/CrossMemory.h"
#include "comm/transport/Env.h"
#include "comm/transport/Log.h"
#include "comm/transport/Spin.h"
#include "comm/transport/Trace.h"

namespace dicomm {

StreamPair::StreamPair(int peer, std::vector<Fd> fds, Inbox* inbox, StreamConfig config,
                       pid_t peerPid, bool remoteOk)
    : peer_(peer), inbox_(inbox), config_(config), peerPid_(peerPid), remoteOk_(remoteOk),
      lanes_([&] {
        std::vector<std::unique_ptr<Lane>> lanes;
        for (auto& fd : fds) {
          lanes.push_back(std::make_unique<Lane>());
          lanes.back()->fd = std::move(fd);
        }
        return lanes;
      }()),
      main_(*lanes_.at(0)),
      mainReady_(::epoll_create1(EPOLL_CLOEXEC)),
      parkBell_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
      pollerBell_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
      latch_(config.name, peer),
      dataLanesOpen_(static_cast<int>(lanes_.size()) - 1) {
  auto watch = [&](int fd) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    return ::epoll_ctl(mainReady_.get(), EPOLL_CTL_ADD, fd, &ev) == 0;
  };
  if (!mainReady_ || !parkBell_ || !pollerBell_ || !watch(main_.fd.get()) || !watch(parkBell_.get())) {
    throw TransportError(peer, std::string(config_.name) + ": setting up the receive thread's "
                                   "epoll set for rank " + std::to_string(peer) + " failed: " +
                                   errnoString(errno));
  }
  if (!config_.tcp && remoteOk_ && config_.smallFrameRing) {
    std::string why;
    ringIn_ = SmallFrameRing::create(&why);
    if (!ringIn_) {
      logLine(LogLevel::kInfo, std::string(config_.name) + ": no small-frame ring from rank " +
                                   std::to_string(peer) + " (" + why + "); small messages take the socket");
    }
  }
}

std::shared_ptr<StreamPair> StreamPair::start(int peer, std::vector<Fd> fds, Inbox* inbox,
                                              StreamConfig config, pid_t peerPid, bool remoteOk) {
  auto pair = std::make_shared<StreamPair>(peer, std::move(fds), inbox, config, peerPid, remoteOk);
  for (auto& lane : pair->lanes_) {
    Lane* l = lane.get();
    l->rx = std::thread([self = pair, l] { l == &self->main_ ? self->mainRxLoop() : self->laneRxLoop(*l); });
    l->tx = std::thread([self = pair, l] { self->txLoop(*l); });
  }
  if (pair->ringIn_) {
    pair->queueControl(kRingOffer, SmallFrameRing::bytes(), 0, static_cast<uint64_t>(pair->ringIn_->fd()));
  }
  return pair;
}

StreamPair::~StreamPair() { close(); }

void StreamPair::send(const Envelope& envelope, const void* data, MemoryKind memory,
                      SendDone done) {
  if (memory != MemoryKind::kHost) {
    done(latch_.error(std::string(config_.name) + ": cannot read device memory directly"));
    return;
  }
  Outgoing out;
  out.frame.envelope = envelope;
  out.data = data;
  const bool remote = remoteOk_ && envelope.nbytes >= config_.remoteThreshold;
  const bool rts = !remote && envelope.nbytes >= config_.rendezvousThreshold;
  out.frame.kind = remote ? kRemote : (rts ? kRts : kInline);
  out.frame.address = reinterpret_cast<uint64_t>(data);
  out.wireBytes = (remote || rts) ? 0 : envelope.nbytes;
  out.done = std::move(done);
  if (remote || rts) unpark();  // the answer (kAck, kCts) must be read even if nobody polls

  std::unique_lock<std::mutex> lock(mu_);
  if (!latch_.up()) {
    auto err = latch_.error();
    lock.unlock();
    out.done(err);
    return;
  }
  out.frame.seq = nextSeq_++;
  if (rts) {
    // The payload goes later, when the receiver answers kCts.
    Outgoing later;
    later.frame = out.frame;
    later.frame.kind = kData;
    later.data = data;
    later.wireBytes = envelope.nbytes;
    later.done = std::move(out.done);
    awaitingCts_.emplace(out.frame.seq, std::move(later));
    out.done = [](std::exception_ptr) {};
  }
  if (out.wireBytes <= config_.inlineWriteMax && claimIdleLocked(main_)) {
    // Latency path: write from this thread; a small message into the peer's ring while a thread
    // there polls it (everything sent before is on the socket already: the lane was idle).
    SmallFrameRing* ring = out.frame.kind == kInline ? ringOut_.get() : nullptr;
    if (remote) awaitingAck_.emplace(out.frame.seq, std::move(out.done));
    lock.unlock();
    std::string error;
    try {
      using Put = SmallFrameRing::Put;
      const Put put = ring ? ring->publish(&out.frame, data, out.wireBytes) : Put::kReaderAway;
      if (put == Put::kPublishedWake) {
        Outgoing bell;
        bell.frame.kind = kRingBell;
        writeFrame(main_, bell);
      } else if (put != Put::kPublished) {
        writeFrame(main_, out);
      }
      trace::mark(trace::kSendWritten);
    } catch (const std::exception& e) {
      error = e.what();
    }
    releaseLane(main_);
    if (!error.empty()) {
      auto cause = failWrite(error);
      if (!remote) out.done(cause);
    } else if (!remote) {
      out.done(nullptr);
    }
    return;
  }
  main_.queue.push_back(std::move(out));
  lock.unlock();
  main_.cv.notify_one();
}

std::string StreamPair::congestion() const {
  return config_.tcp ? congestionControl(main_.fd.get()) : "";
}

bool StreamPair::claimIdleLocked(Lane& lane) {
  if (lane.writing || !lane.queue.empty()) return false;
  lane.writing = true;
  return true;
}

void StreamPair::releaseLane(Lane& lane) {
  bool queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lane.writing = false;
    queued = !lane.queue.empty();
  }
  if (queued) lane.cv.notify_one();
}

void StreamPair::writeFrame(Lane& lane, const Outgoing& out) {
  iovec iov[2];
  iov[0].iov_base = reinterpret_cast<char*>(const_cast<Frame*>(&out.frame)) + out.headerSent;
  iov[0].iov_len = sizeof(Frame) - out.headerSent;
  int n = 1;
  if (out.wireBytes > 0) {
    iov[1].iov_base = const_cast<void*>(out.data);
    iov[1].iov_len = out.wireBytes;
    n = 2;
  }
  writevAll(lane.fd.get(), iov, n, peer_, config_.name);
}

void StreamPair::txLoop(Lane& lane) {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    lane.cv.wait(lock, [&] { return !latch_.up() || (!lane.queue.empty() && !lane.writing); });
    if (!latch_.up()) return;
    Outgoing out = std::move(lane.queue.front());
    lane.queue.pop_front();
    lane.writing = true;  // claimed: the queue's head, our turn
    const bool remote = out.frame.kind == kRemote;
    if (remote) awaitingAck_.emplace(out.frame.seq, std::move(out.done));
    lock.unlock();
    std::string error;
    try {
      writeFrame(lane, out);
      if (out.frame.kind == kInline) trace::mark(trace::kSendWritten);
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (error.empty() && out.done) {
      out.done(nullptr);
      wakePoller();
    }
    releaseLane(lane);
    if (!error.empty()) {
      auto cause = failWrite(error);
      if (out.done) out.done(cause);
      return;
    }
    lock.lock();
  }
}

void StreamPair::sendRendezvousPayload(Outgoing payload) {
  // Called with mu_ held. A payload of one part goes whole, in order with everything else;
  // a larger one is cut into parts of at most kMaxPartBytes, dealt round the lanes (at least
  // one part per lane from stripeMin on).
  const size_t n = payload.wireBytes;
  const size_t striped = lanes_.size() > 1 && n >= config_.stripeMin ? lanes_.size() : 1;
  const size_t parts = std::max(striped, (n + kMaxPartBytes - 1) / kMaxPartBytes);
  if (parts == 1) {
    main_.queue.push_back(std::move(payload));
    main_.cv.notify_one();
    return;
  }
  // The send completes when the last part is written; the first error wins.
  struct Joint {
    std::mutex mu;
    size_t left;
    std::exception_ptr error;
    SendDone done;
  };
  constexpr size_t kAlign = RendezvousBook::kPartAlign;  // the receiver refuses parts off this grid
  const size_t step = ((n + parts - 1) / parts + kAlign - 1) / kAlign * kAlign;
  auto joint = std::make_shared<Joint>();
  joint->left = (n + step - 1) / step;  // can be fewer than the lanes for small odd sizes
  joint->done = std::move(payload.done);
  for (size_t i = 0, off = 0; off < n; i = (i + 1) % lanes_.size(), off += step) {
    Outgoing part;
    part.frame = payload.frame;
    part.frame.kind = kPart;
    part.frame.address = off;
    part.frame.envelope.nbytes = std::min(step, n - off);
    part.data = static_cast<const char*>(payload.data) + off;
    part.wireBytes = part.frame.envelope.nbytes;
    part.done = [joint](std::exception_ptr e) {
      SendDone done;
      std::exception_ptr error;
      {
        std::lock_guard<std::mutex> lock(joint->mu);
        if (e && !joint->error) joint->error = e;
        if (--joint->left > 0) return;
        done = std::move(joint->done);
        error = joint->error;
      }
      if (done) done(error);
    };
    lanes_[i]->queue.push_back(std::move(part));
    lanes_[i]->cv.notify_one();
  }
}

void StreamPair::pullRemote(const Frame& frame, void* dst) {
  const size_t n = frame.envelope.nbytes;
  if (const int err = readProcessMemory(peerPid_, dst, frame.address, n, config_.parallelPull)) {
    throw TransportError(peer_, std::string(config_.name) + ": reading " + std::to_string(n) +
                                    " bytes from rank " + std::to_string(peer_) +
                                    " by cross-memory attach failed: " + errnoString(err));
  }
}

ssize_t StreamPair::fillMain(bool block) {
  RxBuffer& b = rxBuf_;
  if (b.begin == b.end) {
    b.begin = b.end = 0;
  } else if (b.end == b.bytes.size()) {
    std::memmove(b.bytes.data(), b.bytes.data() + b.begin, b.end - b.begin);
    b.end -= b.begin;
    b.begin = 0;
  }
  ssize_t k;
  do {
    k = ::recv(main_.fd.get(), b.bytes.data() + b.end, b.bytes.size() - b.end,
               block ? 0 : MSG_DONTWAIT);
  } while (k < 0 && errno == EINTR);
  if (k < 0) {
    if (!block && (errno == EAGAIN || errno == EWOULDBLOCK)) return -1;
    throw TransportError(peer_, std::string(config_.name) + ": " + brokeCause(peer_, errno));
  }
  b.end += static_cast<size_t>(k);
  return k;
}

bool StreamPair::mainReadable() { return rxBuf_.size() > 0 || fillMain(false) != -1; }

bool StreamPair::readMain(void* dst, size_t n, bool eofOk) {
  char* d = static_cast<char*>(dst);
  RxBuffer& b = rxBuf_;
  bool started = false;
  while (n > 0) {
    if (b.size() == 0) {
      if (n >= b.bytes.size() / 2) {
        // A large remainder goes straight into place, no copy through the buffer.
        return readAll(main_.fd.get(), d, n, peer_, config_.name, eofOk && !started);
      }
      if (fillMain(true) == 0) {
        if (eofOk && !started) return false;
        throw TransportError(peer_, std::string(config_.name) + ": " + eofCause(peer_));
      }
    }
    const size_t k = std::min(n, b.size());
    std::memcpy(d, b.bytes.data() + b.begin, k);
    b.begin += k;
    d += k;
    n -= k;
    started = true;
  }
  return true;
}

void StreamPair::readInto(Lane& lane, void* dst, size_t n, bool keep) {
  auto read = [&](void* to, size_t k) {
    if (&lane == &main_) {
      readMain(to, k, /*eofOk=*/false);
    } else {
      readAll(lane.fd.get(), to, k, peer_, config_.name);
    }
  };
  if (keep) {
    read(dst, n);
    return;
  }
  std::vector<char> sink(std::min<size_t>(n, 1 << 20));
  for (size_t left = n; left > 0;) {
    size_t k = std::min(left, sink.size());
    read(sink.data(), k);
    left -= k;
  }
}

void StreamPair::queueControl(Kind kind, uint64_t seq, int32_t status, uint64_t address) {
  Outgoing out;
  out.frame.kind = kind;
  out.frame.seq = seq;
  out.frame.status = status;
  out.frame.address = address;
  std::unique_lock<std::mutex> lock(mu_);
  if (!latch_.up()) return;
  if (claimIdleLocked(main_)) {
    // Saves the send thread's wake-up. The caller reads sockets, so it must never block on a
    // full one (two peers would stop draining each other): it writes what fits now and queues
    // the rest, first in line.
    lock.unlock();
    ssize_t k;
    do {
      k = ::send(main_.fd.get(), &out.frame, sizeof(Frame), MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (k < 0 && errno == EINTR);
    const int err = errno;
    if (k < 0 && err != EAGAIN && err != EWOULDBLOCK) {
      releaseLane(main_);
      failWrite(std::string(config_.name) + ": send to rank " + std::to_string(peer_) +
                " failed: " + errnoString(err));
      return;
    }
    if (k == static_cast<ssize_t>(sizeof(Frame))) {
      releaseLane(main_);
      return;
    }
    out.headerSent = k > 0 ? static_cast<size_t>(k) : 0;
    lock.lock();
    main_.queue.push_front(std::move(out));
    lock.unlock();
    releaseLane(main_);  // the send thread writes the rest
    return;
  }
  // Ahead of queued messages and payload parts (an answer refers to the peer's sequence, not
  // to anything queued here), behind a frame already cut short and earlier answers.
  auto at = main_.queue.begin();
  while (at != main_.queue.end() && (at->headerSent > 0 || at->frame.kind == kCts || at->frame.kind == kAck)) ++at;
  main_.queue.insert(at, std::move(out));
  lock.unlock();
  main_.cv.notify_one();
}

void StreamPair::pullAndAck(const Frame& frame, Landing landing) {
  const Envelope& env = frame.envelope;
  std::exception_ptr error;
  int32_t status = 0;
  if (landing.data && landing.capacity >= env.nbytes && env.nbytes > 0) {
    try {
      pullRemote(frame, landing.data);
    } catch (const std::exception& e) {
      error = latch_.error(e.what());
      status = EFAULT;
    }
  }
  queueControl(kAck, frame.seq, status);
  if (landing.done) landing.done(error);
}

void StreamPair::receivePayload(const Frame& frame) {
  const Envelope& env = frame.envelope;
  if (frame.kind == kRemote && !remoteOk_) {
    // Only a pair whose two ends proved cross-memory attach may name an address to read:
    // over tcp the pid in the peer's Hello belongs to another host.
    throw TransportError(peer_, protocolError("a cross-memory frame on a pair that does not use "
                                              "cross-memory attach"));
  }
  if (frame.kind == kRemote) {
    // Copied straight from the sender's memory once a receive is posted (maybe later, by the
    // thread that posts it).
    inbox_->arriveWhenPosted(peer_, env, [this, frame](Landing l) { pullAndAck(frame, std::move(l)); });
    return;
  }
  if (frame.kind == kRts) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (incoming_.pending(frame.seq)) throw TransportError(peer_, announcedTwice(frame.seq));
    }
    // A second announcement of a sequence whose first still waits for its receive is caught
    // when its own receive matches (below): only then does it have a landing to fail.
    inbox_->arriveWhenPosted(peer_, env, [this, seq = frame.seq, n = env.nbytes](Landing l) {
      std::exception_ptr gone;
      bool twice = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!latch_.up()) {
          gone = latch_.error();
        } else {
          twice = !incoming_.expect(seq, l, n);
        }
      }
      if (twice) {
        const std::string cause = announcedTwice(seq);
        if (l.done) l.done(latch_.error(cause));
        fail(cause);
        return;
      }
      if (gone) {
        if (l.done) l.done(gone);
        return;
      }
      unpark();  // the payload may come on the main lane
      queueControl(kCts, seq);
    });
    return;
  }
  Landing landing;
  if (frame.kind == kData) {
    std::lock_guard<std::mutex> lock(mu_);
    try {
      landing = incoming_.takeWhole(frame.seq, env.nbytes);
    } catch (const std::invalid_argument& e) {
      throw TransportError(peer_, protocolError(e.what()));
    }
  } else {
    landing = inbox_->arrive(peer_, env);
  }
  const bool keep = landing.data != nullptr && landing.capacity >= env.nbytes;
  try {
    readInto(main_, landing.data, env.nbytes, keep);
  } catch (const std::exception& e) {
    // The landing's owner must hear about the failure (Landing::done runs exactly once).
    if (landing.done) landing.done(latch_.error(e.what()));
    throw;
  }
  if (landing.done) landing.done(nullptr);
}

std::string StreamPair::protocolError(const std::string& what) const {
  return std::string(config_.name) + ": protocol error from rank " + std::to_string(peer_) + ": " +
         what;
}

std::string StreamPair::announcedTwice(uint64_t seq) const {
  return protocolError("sequence " + std::to_string(seq) +
                       " announced twice while its transfer is pending");
}

void StreamPair::receivePart(Lane& lane, const Frame& frame) {
  const size_t off = frame.address, n = frame.envelope.nbytes;
  char* dst = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    try {
      dst = incoming_.claimPart(frame.seq, off, n);
    } catch (const std::invalid_argument& e) {
      throw TransportError(peer_, protocolError(e.what()));
    }
  }
  // The landing stays in the book while parts arrive: a failure meanwhile fails it there.
  readInto(lane, dst, n, dst != nullptr);
  Landing done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!incoming_.partLanded(frame.seq, n, &done)) return;
  }
  if (done.done) done.done(nullptr);
  wakePoller();
}

void StreamPair::wakePoller() {
  if (!polling_.load()) return;
  const uint64_t one = 1;
  (void)!::write(pollerBell_.get(), &one, sizeof(one));
}

void StreamPair::acceptRingOffer(const Frame& frame) {
  if (config_.tcp || !remoteOk_) {
    // As for kRemote: over tcp the pid in the peer's Hello belongs to another host.
    throw TransportError(peer_, protocolError("a small-frame ring offered on a pair that does not use "
                                              "cross-memory attach"));
  }
  std::string why;
  std::unique_ptr<SmallFrameRing> ring;
  if (frame.seq != SmallFrameRing::bytes() || frame.address > static_cast<uint64_t>(INT_MAX)) {
    why = "offered as " + std::to_string(frame.seq) + " bytes at descriptor " + std::to_string(frame.address) +
          ", expected " + std::to_string(SmallFrameRing::bytes()) + " bytes";
  } else {
    ring = SmallFrameRing::openPeer(peerPid_, static_cast<int>(frame.address), &why);
  }
  if (!ring) {
    logLine(LogLevel::kInfo, std::string(config_.name) + ": rank " + std::to_string(peer_) +
                                 "'s small-frame ring is not usable (" + why + "); small messages take the socket");
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!ringOut_) ringOut_ = std::move(ring);
}

bool StreamPair::drainRing(uint64_t below) {
  bool any = false;
  while (!down_.load()) {
    bool corrupt = false;
    const char* slot = ringIn_->peek(&corrupt);
    if (corrupt) {
      throw TransportError(peer_, protocolError("its small-frame ring counts more messages than the ring holds"));
    }
    if (!slot) break;
    Frame frame;
    std::memcpy(&frame, slot, sizeof(frame));
    // An earlier message still on the socket goes first (the caller reads it, then comes back).
    if (frame.seq >= below || frame.seq > lastMessageSeq_ + 1) break;
    if (frame.kind != kInline || frame.envelope.nbytes > SmallFrameRing::kPayloadMax) {
      throw TransportError(peer_, protocolError("a small-frame ring slot of kind " + std::to_string(frame.kind) +
                                                " with " + std::to_string(frame.envelope.nbytes) + " bytes"));
    }
    lastMessageSeq_ = frame.seq;
    trace::mark(trace::kRecvFrame);
    Landing landing = inbox_->arrive(peer_, frame.envelope);
    if (landing.data && landing.capacity >= frame.envelope.nbytes && frame.envelope.nbytes > 0) {
      std::memcpy(landing.data, slot + SmallFrameRing::kHeaderBytes, frame.envelope.nbytes);
    }
    ringIn_->consume();  // the copy is out: the writer may reuse the slot
    if (landing.done) landing.done(nullptr);
    any = true;
  }
  return any;
}

bool StreamPair::readMainFrame() {
  Frame frame;
  const bool more = readMain(&frame, sizeof(frame), /*eofOk=*/true);
  const bool message = more && (frame.kind == kInline || frame.kind == kRemote || frame.kind == kRts);
  // Ring messages sent before this frame (all of them on a bell, at the end of the stream).
  if (ringIn_) drainRing(message ? frame.seq : UINT64_MAX);
  if (!more) {
    bool goodbye;
    {
      std::unique_lock<std::mutex> lock(mu_);
      goodbye = peerSaidGoodbye_;
      // A peer that shut down cleanly wrote every part it sent before its goodbye, but parts on
      // the data lanes may still be on their way: let those lanes drain to their own EOF first,
      // or a message the peer completed would be failed here.
      if (goodbye) {
        downCv_.wait_for(lock, kDrainGrace, [&] { return dataLanesOpen_ == 0 || !latch_.up(); });
      }
    }
    fail(std::string(config_.name) + ": " +
             (goodbye ? "connection to rank " + std::to_string(peer_) +
                            " closed: that rank shut down its process group"
                      : eofCause(peer_)),
         goodbye);
    return false;
  }
  switch (frame.kind) {
    case kInline:
    case kRemote:
    case kRts:
      lastMessageSeq_ = std::max(lastMessageSeq_, frame.seq);
      trace::mark(trace::kRecvFrame);
      receivePayload(frame);
      // Ring messages that waited for this one (their reader may have left since).
      if (ringIn_) drainRing(UINT64_MAX);
      return true;
    case kData:
      receivePayload(frame);
      return true;
    case kRingOffer:
      acceptRingOffer(frame);
      return true;
    case kRingBell:  // the ring was drained above
      return true;
    case kPart:
      receivePart(main_, frame);
      return true;
    case kCts: {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = awaitingCts_.find(frame.seq);
      if (it != awaitingCts_.end() && latch_.up()) {
        sendRendezvousPayload(std::move(it->second));
        awaitingCts_.erase(it);
      }
      return true;
    }
    case kAck: {
      SendDone done;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = awaitingAck_.find(frame.seq);
        if (it != awaitingAck_.end()) {
          done = std::move(it->second);
          awaitingAck_.erase(it);
        }
      }
      if (done) {
        done(frame.status == 0
                 ? nullptr
                 : latch_.error(std::string(config_.name) + ": rank " + std::to_string(peer_) +
                                        " could not read the message from this process: " +
                                        errnoString(frame.status)));
      }
      return true;
    }
    case kGoodbye: {
      std::lock_guard<std::mutex> lock(mu_);
      peerSaidGoodbye_ = true;
      return true;
    }
    default:
      fail(protocolError("unknown frame kind " + std::to_string(frame.kind)));
      return false;
  }
}

void StreamPair::watchMain(bool on) {
  // The socket stays registered; a poller only masks its events: one EPOLL_CTL_MOD is cheaper
  // than a DEL and an ADD (which unlink and re-link the socket's wait queue), twice per polled
  // message. Errors and hang-ups still wake the receive thread while masked:
  // it yields until the poller, which meets the same error on its next read, lets go.
  epoll_event ev{};
  ev.events = on ? EPOLLIN : 0;
  ev.data.fd = main_.fd.get();
  ::epoll_ctl(mainReady_.get(), EPOLL_CTL_MOD, main_.fd.get(), &ev);
}

void StreamPair::unmaskLocked() {
  if (masked_.load()) {
    watchMain(true);
    masked_ = false;
  }
  unparkWanted_ = false;
}

bool StreamPair::parkOver(bool alarm) const {
  if (alarm || unparkWanted_.load()) return true;
  return Clock::now().time_since_epoch() - std::chrono::nanoseconds(parkedAt_.load()) >= kParkGrace;
}

void StreamPair::unpark() {
  if (!masked_.load()) return;
  unparkWanted_ = true;
  // A thread inside readMainFrame() (this one, or another holding readMu_) sees the flag when it
  // lets go. Should the holder let go between its check and this try_lock, the receive thread
  // still takes over after kParkGrace.
  if (reader_.load() == std::this_thread::get_id()) return;
  std::unique_lock<std::mutex> reading(readMu_, std::try_to_lock);
  if (reading) unmaskLocked();
}

void StreamPair::mainRxLoop() {
  const int fd = main_.fd.get();
  try {
    while (!down_.load()) {
      // Poll a little before sleeping while the host is quiet (PollPhase), unless a waiting
      // thread reads or parked.
      if (config_.spin.count() > 0 && !masked_.load()) {
        PollPhase poll;
        const auto until = Clock::now() + poll.budget();
        for (unsigned round = 0; !polling_.load(std::memory_order_relaxed) && !masked_.load() &&
                                 !readableNow(fd) && !hostBusy() && Clock::now() < until;
             ++round) {
          if (round == 0) sampleHostLoad(/*callerPolls=*/true);  // idle now: see Spin.h
          std::this_thread::yield();
        }
      }
      // While masked, wake when a parking poller's grace would end (never sooner than 1 ms).
      // sleepsUntimed_ is set before masked_ is read, and a poller sets masked_ before it reads
      // sleepsUntimed_ (at park): one of the two sees the other, so a park is never slept
      // through.
      sleepsUntimed_ = true;
      int timeoutMs = -1;
      if (masked_.load()) {
        sleepsUntimed_ = false;
        const auto left = std::chrono::nanoseconds(parkedAt_.load()) + kParkGrace -
                          Clock::now().time_since_epoch();
        timeoutMs = static_cast<int>(std::max<int64_t>(
            1, std::chrono::ceil<std::chrono::milliseconds>(left).count()));
      }
      epoll_event ev;
      const int n = ::epoll_wait(mainReady_.get(), &ev, 1, timeoutMs);
      sleepsUntimed_ = false;
      if (n < 0 && errno != EINTR) {
        throw TransportError(peer_, std::string(config_.name) + ": waiting for frames from rank " +
                                        std::to_string(peer_) + " failed: " + errnoString(errno));
      }
      const bool bell = n > 0 && ev.data.fd == parkBell_.get();
      if (bell) {
        uint64_t rings;
        (void)!::read(parkBell_.get(), &rings, sizeof(rings));
      }
      // With the socket masked, epoll reports only an error or hang-up on it.
      const bool alarm = n > 0 && !bell;
      std::unique_lock<std::mutex> reading(readMu_, std::try_to_lock);
      if (!reading) {
        std::this_thread::yield();  // a waiting thread is reading
        continue;
      }
      if (down_.load()) continue;
      if (masked_.load()) {
        if (!parkOver(alarm)) continue;
        unmaskLocked();
      }
      if (!mainReadable()) continue;
      reader_ = std::this_thread::get_id();
      bool more;
      do {
        more = readMainFrame();
      } while (more && rxBuf_.size() > 0 && !down_.load());  // leave nothing buffered behind the lock
      reader_ = std::thread::id();
      if (!more) return;
    }
  } catch (const std::exception& e) {
    reader_ = std::thread::id();
    fail(e.what());
  }
}

bool StreamPair::progress(const std::atomic<bool>& done, Clock::time_point until, bool block) {
  if (down_.load()) return false;
  std::unique_lock<std::mutex> reading(readMu_, std::try_to_lock);
  if (!reading || down_.load()) return false;
  reader_ = std::this_thread::get_id();
  polling_ = true;
  if (!masked_.load()) {
    watchMain(false);
    masked_ = true;
  }
  // The ring: awake while this thread polls it; a sleeping poller (block) is away, and the peer
  // writes to the socket or rings its bell there (SmallFrameRing.h).
  if (ringIn_) block ? ringIn_->setAway() : ringIn_->setAwake();
  std::string error;
  try {
    bool up = true;
    unsigned idle = 0;
    while (up && !done.load(std::memory_order_acquire) && !down_.load()) {
      if (ringIn_ && drainRing(UINT64_MAX)) continue;  // (before a block: the look after going away)
      // poll() first: it reads the socket's state without taking the socket's lock, so a
      // spinning recv() does not hold that lock when the peer's segment lands (a segment that
      // finds it held waits in the backlog until the recv lets go, one round later).
      if ((rxBuf_.size() > 0 || readableNow(main_.fd.get())) && mainReadable()) {
        up = readMainFrame();
      } else if (Clock::now() < until && (block || !hostBusy())) {  // relax() samples the host
        if (block) {
          // Wake on the peer's next frame, or on the bell a lane's thread rings when it
          // completes an op (a striped part, a send): those set `done` with no frame here.
          pollfd p[2] = {{main_.fd.get(), POLLIN, 0}, {pollerBell_.get(), POLLIN, 0}};
          if (::poll(p, 2, 5) > 0 && (p[1].revents & POLLIN)) {
            uint64_t rings;
            (void)!::read(pollerBell_.get(), &rings, sizeof(rings));
          }
        } else if (ringIn_ && idle % 16 != 0 && idle % 16 != 15) {
          // relax()'s pause, but ending as soon as the peer publishes in the ring (relax's rounds
          // that sample the host or yield the core are kept).
          const auto stop = Clock::now() + std::chrono::microseconds(1);
          while (!ringIn_->pending() && Clock::now() < stop) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            asm volatile("yield");
#endif
          }
          ++idle;
        } else {
          relax(idle++);
        }
      } else {
        break;
      }
    }
    // Frames already buffered are handled here: the receive thread waits on the socket only.
    while (up && rxBuf_.size() > 0 && !down_.load()) up = readMainFrame();
    if (ringIn_) {
      // Away, then one more look: a message published meanwhile is taken here, or its writer
      // saw this thread away and rang the bell on the socket.
      ringIn_->setAway();
      if (up && !down_.load()) drainRing(UINT64_MAX);
    }
  } catch (const std::exception& e) {
    if (ringIn_) ringIn_->setAway();
    error = e.what();
  }
  // Park only after a success: a waiter that ran out of time sleeps next, and the receive thread
  // must read for it.
  if (error.empty() && done.load() && !down_.load() && !unparkWanted_.load()) {
    parkedAt_ = Clock::now().time_since_epoch().count();
    if (sleepsUntimed_.load()) {
      // Once per run of parks: the receive thread must time the grace from now on.
      const uint64_t one = 1;
      (void)!::write(parkBell_.get(), &one, sizeof(one));
    }
  } else {
    unmaskLocked();
  }
  polling_ = false;
  reader_ = std::thread::id();
  reading.unlock();
  if (!error.empty()) fail(error);
  return true;
}

void StreamPair::laneRxLoop(Lane& lane) {
  struct Closed {  // on every way out: the main lane's reader may wait for this lane (kDrainGrace)
    StreamPair* pair;
    ~Closed() {
      {
        std::lock_guard<std::mutex> lock(pair->mu_);
        --pair->dataLanesOpen_;
      }
      pair->downCv_.notify_all();
    }
  } closed{this};
  try {
    while (true) {
      Frame frame;
      // EOF between frames: the peer closed (cleanly or not); the main lane tells which.
      if (!readAll(lane.fd.get(), &frame, sizeof(frame), peer_, config_.name, /*eofOk=*/true)) return;
      if (frame.kind != kPart) {
        fail(protocolError("frame kind " + std::to_string(frame.kind) + " on a data lane"));
        return;
      }
      receivePart(lane, frame);
    }
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void StreamPair::Orphans::failAll(const std::exception_ptr& error) {
  for (auto& out : sends) {
    if (out.done) out.done(error);
  }
  for (auto& done : acks) done(error);
  for (auto& l : landings) {
    if (l.done) l.done(error);
  }
}

StreamPair::Orphans StreamPair::takePendingLocked() {
  Orphans o;
  for (auto& lane : lanes_) {
    for (auto& out : lane->queue) o.sends.push_back(std::move(out));
    lane->queue.clear();
  }
  for (auto& kv : awaitingAck_) o.acks.push_back(std::move(kv.second));
  awaitingAck_.clear();
  for (auto& kv : awaitingCts_) o.sends.push_back(std::move(kv.second));
  awaitingCts_.clear();
  o.landings = incoming_.takeAll();
  return o;
}

void StreamPair::shutdownLanes() {
  down_ = true;
  for (auto& lane : lanes_) {
    lane->cv.notify_all();
    ::shutdown(lane->fd.get(), SHUT_RDWR);  // wakes the lane's threads
  }
  watchMain(true);  // even while a poller had the main socket's events masked, or parked it
}

std::exception_ptr StreamPair::failWrite(const std::string& cause) {
  // A write fails because the peer closed its end. A peer that aborted sent its notice first, so
  // the main lane's reader is about to report that root cause: give it a moment to take the
  // pair down before this write's own error does. (Not when this thread is the reader.)
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (reader_.load() != std::this_thread::get_id()) {
      downCv_.wait_for(lock, kReaderGrace, [&] { return !latch_.up(); });
    }
  }
  fail(cause);  // nothing when the reader already failed the pair
  std::lock_guard<std::mutex> lock(mu_);
  return latch_.error();
}

void StreamPair::fail(const std::string& lost, bool cleanClose) {
  {
    // Closed (maybe from a callback on this very thread, its inbox gone since): nothing to say.
    std::lock_guard<std::mutex> lock(mu_);
    if (!latch_.up()) return;
  }
  bool aborted = false;
  const std::string cause = latch_.rootCause(*inbox_, lost, &aborted);
  if (aborted) cleanClose = false;  // its goodbye came from the abort, not from a clean shutdown
  Orphans orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!latch_.fail(cause)) return;
    orphans = takePendingLocked();
  }
  downCv_.notify_all();
  shutdownLanes();
  orphans.failAll(latch_.error());
  if (cleanClose) {
    inbox_->peerClosed(peer_, cause);
  } else {
    inbox_->peerFailed(peer_, cause);
  }
}

void StreamPair::close() {
  Orphans orphans;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (latch_.closing()) return;
    if (!latch_.failed()) {
      // Let the queues drain briefly so the peer gets what was already sent, then say goodbye.
      auto busy = [&] {
        for (auto& lane : lanes_) {
          if (!lane->queue.empty() || lane->writing) return true;
        }
        return false;
      };
      auto until = Clock::now() + std::chrono::seconds(2);
      while (busy() && Clock::now() < until) {
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        lock.lock();
      }
      if (!busy()) {
        Outgoing bye;
        bye.frame.kind = kGoodbye;
        try {
          writeFrame(main_, bye);
        } catch (const std::exception&) {
        }
      }
    }
    latch_.close();
    orphans = takePendingLocked();
  }
  downCv_.notify_all();
  shutdownLanes();
  for (auto& lane : lanes_) {
    for (std::thread* t : {&lane->rx, &lane->tx}) {
      if (!t->joinable()) continue;
      if (t->get_id() == std::this_thread::get_id()) {
        t->detach();  // close() from a completion callback on this pair's own thread
      } else {
        t->join();
      }
    }
  }
  // A thread waiting in progress() leaves on the shutdown; the pair must outlive its visit.
  if (reader_.load() != std::this_thread::get_id()) {
    std::lock_guard<std::mutex> gone(readMu_);
  }
  orphans.failAll(latch_.error());
}

}  // namespace dicomm
