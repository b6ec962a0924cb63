#include "comm/transport/StreamTransport.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "comm/transport/Env.h"
#include "comm/transport/Spin.h"

namespace dicomm {

namespace {

// A word every process owns at a known address: the peer reads it back to prove that
// process_vm_readv works between the two processes before trusting the REMOTE protocol.
const uint64_t kProbeWord = kHelloMagic;

std::exception_ptr makeError(int peer, const std::string& what) {
  return std::make_exception_ptr(TransportError(peer, what));
}

// process_vm_readv until all n bytes are in; returns 0 or errno.
int readRemote(pid_t pid, void* dst, uint64_t src, size_t n) {
  char* d = static_cast<char*>(dst);
  while (n > 0) {
    iovec local{d, n};
    iovec remote{reinterpret_cast<void*>(src), n};
    ssize_t k = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (k == 0) return EFAULT;
    d += k;
    src += static_cast<uint64_t>(k);
    n -= static_cast<size_t>(k);
  }
  return 0;
}

// Between two polls of a socket a waiter pauses about 1 us in user space instead of calling
// sched_yield(): half the syscalls per round. Every 16th round still yields, so a waiter that
// shares its core with the rank it waits for lets that rank run.
void relax(unsigned round) {
  if (round % 16 == 15) {
    std::this_thread::yield();
    return;
  }
  const auto stop = Clock::now() + std::chrono::microseconds(1);
  while (Clock::now() < stop) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
}

// Yama's ptrace_scope (0 when Yama is absent).
int yamaScope() {
  FILE* f = std::fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  if (!f) return 0;
  int scope = 0;
  if (std::fscanf(f, "%d", &scope) != 1) scope = 0;
  std::fclose(f);
  return scope;
}

// Under Yama ptrace_scope=1 only a declared tracer may read this process's memory, and
// PR_SET_PTRACER names one pid while a rank has several local peers: so any process of this
// user is declared, for as long as a shm transport lives (the token), and only where Yama asks
// for it (scope 0 already allows same-user reads; 2 and 3 forbid them whatever is declared).
// Peers are still checked at connect: pid and uid from the socket (SO_PEERCRED).
std::shared_ptr<void> allowSiblingReads() {
  static std::mutex mu;
  static std::weak_ptr<void> current;
  std::lock_guard<std::mutex> lock(mu);
  if (auto held = current.lock()) return held;
  if (yamaScope() != 1) return nullptr;
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  std::shared_ptr<void> token(nullptr, [](void*) {
    std::lock_guard<std::mutex> lock(mu);
    prctl(PR_SET_PTRACER, 0, 0, 0, 0);
  });
  current = token;
  return token;
}

}  // namespace

bool crossMemoryAttachWorks() {
  uint64_t got = 0;
  return readRemote(getpid(), &got, reinterpret_cast<uint64_t>(&kProbeWord), sizeof(got)) == 0 &&
         got == kProbeWord;
}

void StreamConfig::applyEnv() {
  spin = spinBudget();
  socketBuffer = static_cast<int>(envLong("DICOMM_SOCKET_BUFFER", socketBuffer, 0, 1 << 30));
  if (tcp) {
    rendezvousThreshold = static_cast<size_t>(
        envLong("DICOMM_RENDEZVOUS_BYTES", rendezvousThreshold, 0, 1L << 40));
    lanes = static_cast<int>(envLong("DICOMM_TCP_STREAMS", defaultLanes(), 1, 16));
    stripeMin = static_cast<size_t>(envLong("DICOMM_STRIPE_BYTES", stripeMin, 4096, 1L << 40));
    peerTimeoutS = static_cast<int>(envLong("DICOMM_PEER_TIMEOUT", peerTimeoutS, 0, 86400));
    connectTimeoutS = static_cast<int>(envLong("DICOMM_CONNECT_TIMEOUT", connectTimeoutS, 1, 86400));
    const char* cc = std::getenv("DICOMM_TCP_CONGESTION");
    if (cc && *cc) congestion = cc;
    if (congestion != "auto" && congestion != "system") {
      if (const int err = congestionAllowed(congestion)) {
        throw std::invalid_argument(
            "dicomm: DICOMM_TCP_CONGESTION='" + congestion + "': the kernel refuses it (" +
            errnoString(err) + "); expected 'auto', 'system' or an algorithm listed in " +
            "/proc/sys/net/ipv4/tcp_allowed_congestion_control");
      }
    }
  }
}

std::string StreamConfig::congestionFor(int fd) const {
  if (!tcp || congestion == "system") return "";
  if (congestion == "auto") return hostLocal(fd) ? "reno" : "";
  return congestion;
}

int StreamConfig::defaultLanes() {
  // One stream per core, up to 4: each stream keeps a sending and a receiving thread busy.
  unsigned cpus = std::thread::hardware_concurrency();
  return static_cast<int>(std::max(1u, std::min(4u, cpus)));
}

// ---- StreamPair ---------------------------------------------------------------------------

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
}

std::shared_ptr<StreamPair> StreamPair::start(int peer, std::vector<Fd> fds, Inbox* inbox,
                                              StreamConfig config, pid_t peerPid, bool remoteOk) {
  auto pair = std::make_shared<StreamPair>(peer, std::move(fds), inbox, config, peerPid, remoteOk);
  for (auto& lane : pair->lanes_) {
    Lane* l = lane.get();
    l->rx = std::thread([self = pair, l] { l == &self->main_ ? self->mainRxLoop() : self->laneRxLoop(*l); });
    l->tx = std::thread([self = pair, l] { self->txLoop(*l); });
  }
  return pair;
}

StreamPair::~StreamPair() { close(); }

std::exception_ptr StreamPair::failure() const { return makeError(peer_, failure_); }

std::exception_ptr StreamPair::closedError() const {
  return failed_ ? failure()
                 : makeError(peer_, std::string(config_.name) + ": pair to rank " +
                                        std::to_string(peer_) + " is closed");
}

void StreamPair::send(const Envelope& envelope, const void* data, MemoryKind memory,
                      SendDone done) {
  if (memory != MemoryKind::kHost) {
    done(makeError(peer_, std::string(config_.name) + ": cannot read device memory directly"));
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
  if (failed_ || closing_) {
    auto err = closedError();
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
    // Latency path: write from this thread.
    if (remote) awaitingAck_.emplace(out.frame.seq, std::move(out.done));
    lock.unlock();
    std::string error;
    try {
      writeFrame(main_, out);
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
    lane.cv.wait(lock, [&] { return closing_ || failed_ || (!lane.queue.empty() && !lane.writing); });
    if (closing_ || failed_) return;
    Outgoing out = std::move(lane.queue.front());
    lane.queue.pop_front();
    lane.writing = true;  // claimed: the queue's head, our turn
    const bool remote = out.frame.kind == kRemote;
    if (remote) awaitingAck_.emplace(out.frame.seq, std::move(out.done));
    lock.unlock();
    std::string error;
    try {
      writeFrame(lane, out);
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
  const size_t step = ((n + parts - 1) / parts + 4095) & ~size_t(4095);  // page-aligned parts
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
  constexpr size_t kSplitAt = 4 << 20;  // two threads (see StreamConfig::parallelPull)
  int err = 0;
  if (config_.parallelPull && n >= kSplitAt) {
    size_t half = (n / 2 + 4095) & ~size_t(4095);
    int err2 = 0;
    std::thread helper([&] {
      err2 = readRemote(peerPid_, static_cast<char*>(dst) + half, frame.address + half, n - half);
    });
    err = readRemote(peerPid_, dst, frame.address, half);
    helper.join();
    if (!err) err = err2;
  } else {
    err = readRemote(peerPid_, dst, frame.address, n);
  }
  if (err) {
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

void StreamPair::queueControl(Kind kind, uint64_t seq, int32_t status) {
  Outgoing out;
  out.frame.kind = kind;
  out.frame.seq = seq;
  out.frame.status = status;
  std::unique_lock<std::mutex> lock(mu_);
  if (failed_ || closing_) return;
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
      error = makeError(peer_, e.what());
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
    throw TransportError(peer_, std::string(config_.name) + ": protocol error from rank " +
                                    std::to_string(peer_) + ": a cross-memory frame on a pair " +
                                    "that does not use cross-memory attach");
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
      if (expected_.count(frame.seq)) throw TransportError(peer_, announcedTwice(frame.seq));
    }
    // A second announcement of a sequence whose first still waits for its receive is caught
    // when its own receive matches (below): only then does it have a landing to fail.
    inbox_->arriveWhenPosted(peer_, env, [this, seq = frame.seq, n = env.nbytes](Landing l) {
      std::exception_ptr gone;
      bool twice = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (failed_ || closing_) {
          gone = closedError();
        } else if (expected_.count(seq)) {
          twice = true;
        } else {
          expected_.emplace(seq, Expected{std::move(l), n, n});
        }
      }
      if (twice) {
        const std::string cause = announcedTwice(seq);
        if (l.done) l.done(makeError(peer_, cause));
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
    auto it = expected_.find(frame.seq);
    if (it == expected_.end() || it->second.nbytes != env.nbytes) {
      throw TransportError(peer_, std::string(config_.name) + ": protocol error from rank " +
                                      std::to_string(peer_) + ": " + std::to_string(env.nbytes) +
                                      " bytes of data for sequence " + std::to_string(frame.seq) +
                                      (it == expected_.end() ? ", which was never asked for"
                                                             : ", which was asked for " +
                                                                   std::to_string(it->second.nbytes)));
    }
    landing = std::move(it->second.landing);
    expected_.erase(it);
  } else {
    landing = inbox_->arrive(peer_, env);
  }
  const bool keep = landing.data != nullptr && landing.capacity >= env.nbytes;
  try {
    readInto(main_, landing.data, env.nbytes, keep);
  } catch (const std::exception& e) {
    // The landing's owner must hear about the failure (Landing::done runs exactly once).
    if (landing.done) landing.done(makeError(peer_, e.what()));
    throw;
  }
  if (landing.done) landing.done(nullptr);
}

std::string StreamPair::announcedTwice(uint64_t seq) const {
  return std::string(config_.name) + ": protocol error from rank " + std::to_string(peer_) +
         ": sequence " + std::to_string(seq) + " announced twice while its transfer is pending";
}

void StreamPair::receivePart(Lane& lane, const Frame& frame) {
  const size_t off = frame.address, n = frame.envelope.nbytes;
  char* dst = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = expected_.find(frame.seq);
    if (it == expected_.end() || off > it->second.nbytes || n > it->second.nbytes - off ||
        n > it->second.left) {
      throw TransportError(peer_, std::string(config_.name) + ": protocol error from rank " +
                                      std::to_string(peer_) + ": part [" + std::to_string(off) +
                                      ", +" + std::to_string(n) + ") of sequence " +
                                      std::to_string(frame.seq) + " was not expected");
    }
    const Landing& l = it->second.landing;
    if (l.data && l.capacity >= it->second.nbytes) dst = static_cast<char*>(l.data) + off;
  }
  // The landing stays in expected_ while parts arrive: a failure meanwhile fails it there.
  readInto(lane, dst, n, dst != nullptr);
  Landing done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = expected_.find(frame.seq);
    if (it == expected_.end()) return;  // the pair failed meanwhile and completed it
    it->second.left -= n;
    if (it->second.left > 0) return;
    done = std::move(it->second.landing);
    expected_.erase(it);
  }
  if (done.done) done.done(nullptr);
  wakePoller();
}

void StreamPair::wakePoller() {
  if (!polling_.load()) return;
  const uint64_t one = 1;
  (void)!::write(pollerBell_.get(), &one, sizeof(one));
}

bool StreamPair::readMainFrame() {
  Frame frame;
  if (!readMain(&frame, sizeof(frame), /*eofOk=*/true)) {
    bool goodbye;
    {
      std::unique_lock<std::mutex> lock(mu_);
      goodbye = peerSaidGoodbye_;
      // A peer that shut down cleanly wrote every part it sent before its goodbye, but parts on
      // the data lanes may still be on their way: let those lanes drain to their own EOF first,
      // or a message the peer completed would be failed here.
      if (goodbye) {
        downCv_.wait_for(lock, kDrainGrace, [&] { return dataLanesOpen_ == 0 || failed_ || closing_; });
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
    case kData:
      receivePayload(frame);
      return true;
    case kPart:
      receivePart(main_, frame);
      return true;
    case kCts: {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = awaitingCts_.find(frame.seq);
      if (it != awaitingCts_.end() && !failed_ && !closing_) {
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
                 : makeError(peer_, std::string(config_.name) + ": rank " + std::to_string(peer_) +
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
      fail(std::string(config_.name) + ": protocol error from rank " + std::to_string(peer_) +
           ": unknown frame kind " + std::to_string(frame.kind));
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
        while (!polling_.load(std::memory_order_relaxed) && !readableNow(fd) &&
               Clock::now() < until) {
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
  std::string error;
  try {
    bool up = true;
    unsigned idle = 0;
    while (up && !done.load(std::memory_order_acquire) && !down_.load()) {
      // poll() first: it reads the socket's state without taking the socket's lock, so a
      // spinning recv() does not hold that lock when the peer's segment lands (a segment that
      // finds it held waits in the backlog until the recv lets go, one round later).
      if ((rxBuf_.size() > 0 || readableNow(main_.fd.get())) && mainReadable()) {
        up = readMainFrame();
      } else if (Clock::now() < until) {
        if (block) {
          // Wake on the peer's next frame, or on the bell a lane's thread rings when it
          // completes an op (a striped part, a send): those set `done` with no frame here.
          pollfd p[2] = {{main_.fd.get(), POLLIN, 0}, {pollerBell_.get(), POLLIN, 0}};
          if (::poll(p, 2, 5) > 0 && (p[1].revents & POLLIN)) {
            uint64_t rings;
            (void)!::read(pollerBell_.get(), &rings, sizeof(rings));
          }
        } else {
          relax(idle++);
        }
      } else {
        break;
      }
    }
    // Frames already buffered are handled here: the receive thread waits on the socket only.
    while (up && rxBuf_.size() > 0 && !down_.load()) up = readMainFrame();
  } catch (const std::exception& e) {
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
        fail(std::string(config_.name) + ": protocol error from rank " + std::to_string(peer_) +
             ": frame kind " + std::to_string(frame.kind) + " on a data lane");
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
  for (auto& kv : expected_) o.landings.push_back(std::move(kv.second.landing));
  expected_.clear();
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
      downCv_.wait_for(lock, kReaderGrace, [&] { return failed_ || closing_; });
    }
  }
  fail(cause);  // nothing when the reader already failed the pair
  std::lock_guard<std::mutex> lock(mu_);
  return closedError();
}

void StreamPair::fail(const std::string& lost, bool cleanClose) {
  {
    // Closed (maybe from a callback on this very thread, its inbox gone since): nothing to say.
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_ || closing_) return;
  }
  // A peer that aborted said why first (its notice precedes its close on the main lane).
  std::string cause = inbox_->abortNotice(peer_);
  if (cause.empty()) {
    cause = lost;
  } else {
    cleanClose = false;  // its goodbye came from the abort, not from a clean shutdown
  }
  Orphans orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_ || closing_) return;
    failed_ = true;
    failure_ = cause;
    orphans = takePendingLocked();
  }
  downCv_.notify_all();
  shutdownLanes();
  orphans.failAll(makeError(peer_, cause));
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
    if (closing_) return;
    if (!failed_) {
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
    closing_ = true;
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
  orphans.failAll(makeError(peer_, std::string(config_.name) + ": pair to rank " +
                                       std::to_string(peer_) + " closed locally"));
}

// ---- StreamTransport ----------------------------------------------------------------------

std::string StreamTransport::addressKey(int rank) const {
  return ctx_.keyPrefix + config_.name + "/addr/" + std::to_string(rank);
}

void StreamTransport::start(const TransportContext& context) {
  ctx_ = context;
  config_.parallelPull =
      std::thread::hardware_concurrency() >= static_cast<unsigned>(ctx_.localRanks);
  if (config_.tcp) {
    listener_ = listenTcp(ctx_.listen.host);
  } else {
    siblingReads_ = allowSiblingReads();
    char name[96];
    snprintf(name, sizeof(name), "dicomm-%d-%p-%d", getpid(), static_cast<void*>(this),
             ctx_.rank);
    listener_ = listenUnix(name);
  }
  const std::string& a = listener_.address;
  ctx_.store->set(addressKey(ctx_.rank), std::vector<uint8_t>(a.begin(), a.end()));
}

std::string StreamTransport::unreachableKey(int rank) const {
  return ctx_.keyPrefix + config_.name + "/unreachable/" + std::to_string(rank);
}

Fd StreamTransport::takeAccepted(int peer, int lane, Clock::time_point deadline, Hello* theirs) {
  const char* name = config_.name;
  std::unique_lock<std::mutex> lock(acceptMu_);
  while (true) {
    auto it = accepted_.find({peer, lane});
    if (it != accepted_.end()) {
      Fd fd = std::move(it->second.first);
      *theirs = it->second.second;
      accepted_.erase(it);
      return fd;
    }
    // In one-second slices: between them, look whether a dialer gave up on this rank, so that
    // both ends of an unreachable pair fail within seconds, not at the group timeout.
    if (!admitOnce(std::min(deadline, Clock::now() + std::chrono::seconds(1)))) {
      bool given = false;
      try {
        given = ctx_.store->check({unreachableKey(ctx_.rank)});
      } catch (const std::exception& e) {
        // The store's host (often rank 0 itself) went away: its rank failed first.
        throw TransportError(peer, std::string("dicomm ") + name + ": rank " +
                                       std::to_string(peer) + " did not connect, and the store " +
                                       "stopped answering meanwhile (did the rank hosting it fail? " +
                                       "see its error): " + e.what());
      }
      if (given) {
        auto why = ctx_.store->get(unreachableKey(ctx_.rank));
        throw TransportError(peer, std::string("dicomm ") + name + ": a peer could not reach rank " +
                                       std::to_string(ctx_.rank) + " (this rank): " +
                                       std::string(why.begin(), why.end()));
      }
      if (Clock::now() < deadline) continue;
      throw TransportError(peer, std::string("dicomm ") + name + ": rank " +
                                     std::to_string(peer) + " did not connect within " +
                                     std::to_string(ctx_.timeout.count()) +
                                     " ms (did it join the process group?)");
    }
  }
}

bool StreamTransport::admitOnce(Clock::time_point until) {
  // Every connection not yet admitted is read as its bytes come, beside the listener: one that
  // sends nothing (or dribbles) holds up nobody and is dropped after kHelloWindow.
  std::vector<pollfd> fds{{listener_.fd.get(), POLLIN, 0}};
  for (auto& g : greeting_) fds.push_back({g.fd.get(), POLLIN, 0});
  auto soonest = until;
  for (auto& g : greeting_) soonest = std::min(soonest, g.deadline);
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(soonest - Clock::now());
  const int n = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(0, left.count())));
  bool progressed = false;
  for (size_t i = 1; n > 0 && i < fds.size(); ++i) {
    Greeting& g = greeting_[i - 1];
    if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    if (!advanceGreeting(g)) {
      g.fd.reset();
    } else if (g.answered && g.got == sizeof(g.proof)) {
      const int flags = fcntl(g.fd.get(), F_GETFL);
      fcntl(g.fd.get(), F_SETFL, flags & ~O_NONBLOCK);
      accepted_[{g.theirs.rank, g.theirs.lane}] = {std::move(g.fd), g.theirs};
      progressed = true;
    }
  }
  if (n > 0 && (fds[0].revents & POLLIN)) {
    const int c = ::accept4(listener_.fd.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c >= 0) {
      greeting_.push_back(Greeting{});
      greeting_.back().fd = Fd(c);
      greeting_.back().deadline = Clock::now() + kHelloWindow;
      progressed = true;
    }
  }
  const auto now = Clock::now();
  greeting_.erase(std::remove_if(greeting_.begin(), greeting_.end(),
                                 [&](const Greeting& g) { return !g.fd || g.deadline <= now; }),
                  greeting_.end());
  return progressed;
}

bool StreamTransport::advanceGreeting(Greeting& g) {
  char* into = g.answered ? reinterpret_cast<char*>(g.proof) : reinterpret_cast<char*>(&g.theirs);
  const size_t want = g.answered ? sizeof(g.proof) : sizeof(Hello);
  const ssize_t k = ::recv(g.fd.get(), into + g.got, want - g.got, MSG_DONTWAIT);
  if (k < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  if (k == 0) return false;  // closed before it finished
  g.got += static_cast<size_t>(k);
  if (g.got < want) return true;
  if (g.answered) {
    // Admitted only with the proof for this very exchange (our fresh nonce is in it).
    return proofMatches(handshakeProof(ctx_.authKey, HandshakeRole::kDialer, g.theirs, g.mine),
                        g.proof);
  }
  // Not one of ours (wrong magic, rank or lane, or an impostor process): drop it unanswered.
  if (!helloFieldsOk(g.theirs) || !peerCredentialsOk(g.fd.get(), g.theirs)) return false;
  g.mine = myHello(0, 1);
  struct {
    Hello hello;
    Proof proof;
  } answer{g.mine, handshakeProof(ctx_.authKey, HandshakeRole::kAcceptor, g.theirs, g.mine)};
  static_assert(sizeof(answer) == sizeof(Hello) + sizeof(Proof), "no padding on the wire");
  // 96 bytes into a fresh connection's empty send buffer: all or nothing in practice.
  if (::send(g.fd.get(), &answer, sizeof(answer), MSG_DONTWAIT | MSG_NOSIGNAL) !=
      static_cast<ssize_t>(sizeof(answer))) {
    return false;
  }
  g.answered = true;
  g.got = 0;
  return true;
}

bool StreamTransport::helloFieldsOk(const Hello& h) const {
  return h.magic == kHelloMagic && h.rank >= 0 && h.rank < ctx_.size && h.rank != ctx_.rank &&
         h.lanes >= 1 && h.lanes <= kMaxLanes && h.lane >= 0 && h.lane < h.lanes;
}

bool StreamTransport::peerCredentialsOk(int fd, const Hello& h) const {
  if (config_.tcp) return true;  // only a local socket carries the peer's credentials
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
  // The pid matters: it is the process whose memory cross-memory attach will read.
  return cred.pid == h.pid && cred.uid == ::getuid();
}

void StreamTransport::proveAsDialer(int fd, int peer, int lane, int lanes,
                                    Clock::time_point deadline, Hello* theirs) {
  const char* name = config_.name;
  const Hello mine = myHello(lane, lanes);
  writeAll(fd, &mine, sizeof(mine), peer, name);
  uint8_t proof[sizeof(Proof)];
  readAllUntil(fd, theirs, sizeof(*theirs), deadline, peer, name);
  readAllUntil(fd, proof, sizeof(proof), deadline, peer, name);
  const bool authentic =
      theirs->magic == kHelloMagic && theirs->rank == peer &&
      proofMatches(handshakeProof(ctx_.authKey, HandshakeRole::kAcceptor, mine, *theirs), proof) &&
      peerCredentialsOk(fd, *theirs);
  if (!authentic) {
    throw TransportError(peer, std::string("dicomm ") + name + ": the listener at rank " +
                                   std::to_string(peer) + "'s address failed authentication " +
                                   "(not a rank of this process group)");
  }
  const Proof answer = handshakeProof(ctx_.authKey, HandshakeRole::kDialer, mine, *theirs);
  writeAll(fd, answer.data(), answer.size(), peer, name);
}

Fd StreamTransport::dialPeer(int peer, const std::string& address, Clock::time_point deadline) {
  std::string target = address, host, port;
  if (config_.tcp && splitTcpAddress(address, &host, &port)) {
    target = joinTcpAddress(scopedForDialing(host, ctx_.listen), std::stoi(port));
  }
  const auto connectBy =
      config_.tcp ? std::min(deadline, Clock::now() + std::chrono::seconds(config_.connectTimeoutS))
                  : deadline;
  try {
    return dial(target, connectBy, peer);
  } catch (const TransportError& e) {
    std::string why = std::string("rank ") + std::to_string(ctx_.rank) + " " + e.what();
    if (config_.tcp) {
      why += " within " + std::to_string(config_.connectTimeoutS) +
             " s (DICOMM_CONNECT_TIMEOUT). Each rank listens on the address of its interface "
             "that routes to the store; if that one is not reachable from the other hosts, set "
             "DICOMM_SOCKET_IFNAME on rank " + std::to_string(peer) +
             "'s host to an interface that is";
    }
    // Tell the peer, which is waiting for this connection, so it fails now too.
    ctx_.store->set(unreachableKey(peer), std::vector<uint8_t>(why.begin(), why.end()));
    throw TransportError(peer, std::string("dicomm ") + config_.name + ": " + why);
  }
}

Hello StreamTransport::myHello(int lane, int lanes) const {
  Hello mine;
  mine.magic = kHelloMagic;
  mine.rank = ctx_.rank;
  mine.pid = getpid();
  mine.probe = reinterpret_cast<uint64_t>(&kProbeWord);
  freshNonce(mine.nonce);
  mine.lane = lane;
  mine.lanes = lanes;
  return mine;
}

std::shared_ptr<Pair> StreamTransport::connect(int peer) {
  const auto deadline = Clock::now() + ctx_.timeout;
  const char* name = config_.name;
  std::vector<Fd> fds;
  Hello theirs;
  if (ctx_.rank < peer) {
    // The lower rank dials every lane; its lane count holds for the pair.
    std::string key = addressKey(peer);
    try {
      ctx_.store->wait({key}, ctx_.timeout);
    } catch (const std::exception& e) {
      throw TransportError(peer, std::string("dicomm ") + name + ": rank " +
                                     std::to_string(peer) + " did not publish its address within " +
                                     std::to_string(ctx_.timeout.count()) +
                                     " ms (did it join the process group?)");
    }
    auto bytes = ctx_.store->get(key);
    const int lanes = std::max(1, std::min(config_.lanes, kMaxLanes));
    for (int lane = 0; lane < lanes; ++lane) {
      Fd fd = dialPeer(peer, std::string(bytes.begin(), bytes.end()), deadline);
      proveAsDialer(fd.get(), peer, lane, lanes, deadline, &theirs);
      fds.push_back(std::move(fd));
    }
  } else {
    fds.push_back(takeAccepted(peer, 0, deadline, &theirs));
    Hello extra;
    for (int lane = 1; lane < theirs.lanes; ++lane) {
      fds.push_back(takeAccepted(peer, lane, deadline, &extra));
    }
  }
  for (auto& fd : fds) {
    tuneSocket(fd.get(), config_.tcp, config_.socketBuffer, config_.congestionFor(fd.get()),
               config_.tcp ? config_.peerTimeoutS : 0);
  }
  Fd& fd = fds[0];

  bool remoteOk = false;
  if (config_.remoteThreshold != SIZE_MAX) {
    // Both directions must work for REMOTE frames: exchange the probe results.
    uint64_t word = 0;
    uint8_t canRead = readRemote(theirs.pid, &word, theirs.probe, sizeof(word)) == 0 &&
                      word == kProbeWord;
    uint8_t peerCanRead = 0;
    writeAll(fd.get(), &canRead, 1, peer, name);
    readAllUntil(fd.get(), &peerCanRead, 1, deadline, peer, name);
    remoteOk = canRead && peerCanRead;
  }
  return StreamPair::start(peer, std::move(fds), ctx_.inbox, config_, theirs.pid, remoteOk);
}

}  // namespace dicomm
