#include "comm/transport/StreamTransport.h"

#include <errno.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

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

}  // namespace

bool crossMemoryAttachWorks() {
  uint64_t got = 0;
  return readRemote(getpid(), &got, reinterpret_cast<uint64_t>(&kProbeWord), sizeof(got)) == 0 &&
         got == kProbeWord;
}

// ---- StreamPair ---------------------------------------------------------------------------

StreamPair::StreamPair(int peer, Fd fd, Inbox* inbox, StreamConfig config, pid_t peerPid,
                       bool remoteOk)
    : peer_(peer), fd_(std::move(fd)), inbox_(inbox), config_(config), peerPid_(peerPid),
      remoteOk_(remoteOk) {
  rx_ = std::thread([this] { rxLoop(); });
  tx_ = std::thread([this] { txLoop(); });
}

StreamPair::~StreamPair() { close(); }

std::exception_ptr StreamPair::failure() const {
  return makeError(peer_, failure_);
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

  std::unique_lock<std::mutex> lock(mu_);
  if (failed_ || closing_) {
    auto err = failed_ ? failure()
                       : makeError(peer_, std::string(config_.name) + ": pair to rank " +
                                              std::to_string(peer_) + " is closed");
    lock.unlock();
    out.done(err);
    return;
  }
  out.frame.seq = nextSeq_++;
  if (rts) {
    // The payload goes later, as kData, when the receiver answers kCts.
    Outgoing later;
    later.frame = out.frame;
    later.frame.kind = kData;
    later.data = data;
    later.wireBytes = envelope.nbytes;
    later.done = std::move(out.done);
    awaitingCts_.emplace(out.frame.seq, std::move(later));
    out.done = [](std::exception_ptr) {};
  }
  if (queue_.empty() && !txWriting_ && out.wireBytes <= config_.inlineWriteMax) {
    // Latency path: write from this thread; the lock keeps frames in order.
    if (remote) awaitingAck_.emplace(out.frame.seq, std::move(out.done));
    try {
      writeFrame(out);
    } catch (const std::exception& e) {
      lock.unlock();
      fail(e.what());
      if (!remote) out.done(makeError(peer_, e.what()));
      return;
    }
    lock.unlock();
    if (!remote) out.done(nullptr);
    return;
  }
  queue_.push_back(std::move(out));
  lock.unlock();
  cv_.notify_one();
}

void StreamPair::writeFrame(const Outgoing& out) {
  iovec iov[2];
  iov[0].iov_base = const_cast<Frame*>(&out.frame);
  iov[0].iov_len = sizeof(Frame);
  int n = 1;
  if (out.wireBytes > 0) {
    iov[1].iov_base = const_cast<void*>(out.data);
    iov[1].iov_len = out.wireBytes;
    n = 2;
  }
  writevAll(fd_.get(), iov, n, peer_, config_.name);
}

void StreamPair::txLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return closing_ || failed_ || !queue_.empty(); });
    if (closing_ || failed_) return;
    Outgoing out = std::move(queue_.front());
    queue_.pop_front();
    txWriting_ = true;
    const bool remote = out.frame.kind == kRemote;
    if (remote) awaitingAck_.emplace(out.frame.seq, std::move(out.done));
    lock.unlock();
    std::string error;
    try {
      writeFrame(out);
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (error.empty() && out.done) out.done(nullptr);
    lock.lock();
    txWriting_ = false;
    if (!error.empty()) {
      lock.unlock();
      if (out.done) out.done(makeError(peer_, error));
      fail(error);
      return;
    }
  }
}

void StreamPair::pullRemote(const Frame& frame, void* dst) {
  const size_t n = frame.envelope.nbytes;
  // Two threads copy a large payload: one process_vm_readv stream stays well under memcpy speed.
  constexpr size_t kSplitAt = 4 << 20;
  int err = 0;
  if (n >= kSplitAt) {
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

void StreamPair::readInto(void* dst, size_t n, bool keep) {
  if (keep) {
    readAll(fd_.get(), dst, n, peer_, config_.name);
    return;
  }
  std::vector<char> sink(std::min<size_t>(n, 1 << 20));
  for (size_t left = n; left > 0;) {
    size_t k = std::min(left, sink.size());
    readAll(fd_.get(), sink.data(), k, peer_, config_.name);
    left -= k;
  }
}

void StreamPair::queueControl(Kind kind, uint64_t seq, int32_t status) {
  // Receive threads never write the socket themselves (see header): queue the frame.
  Outgoing out;
  out.frame.kind = kind;
  out.frame.seq = seq;
  out.frame.status = status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_ || closing_) return;
    queue_.push_back(std::move(out));
  }
  cv_.notify_one();
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
  if (frame.kind == kRemote) {
    // Copied straight from the sender's memory once a receive is posted (maybe later, by the
    // thread that posts it).
    inbox_->arriveWhenPosted(peer_, env, [this, frame](Landing l) { pullAndAck(frame, std::move(l)); });
    return;
  }
  if (frame.kind == kRts) {
    inbox_->arriveWhenPosted(peer_, env, [this, seq = frame.seq](Landing l) {
      std::exception_ptr gone;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (failed_ || closing_) {
          gone = failed_ ? failure()
                         : makeError(peer_, std::string(config_.name) + ": pair to rank " +
                                                std::to_string(peer_) + " is closed");
        } else {
          rendezvousLanding_.emplace(seq, std::move(l));
        }
      }
      if (gone) {
        if (l.done) l.done(gone);
        return;
      }
      queueControl(kCts, seq);
    });
    return;
  }
  Landing landing;
  if (frame.kind == kData) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rendezvousLanding_.find(frame.seq);
    if (it == rendezvousLanding_.end()) {
      throw TransportError(peer_, std::string(config_.name) + ": protocol error from rank " +
                                      std::to_string(peer_) + ": data for unknown sequence " +
                                      std::to_string(frame.seq));
    }
    landing = std::move(it->second);
    rendezvousLanding_.erase(it);
  } else {
    landing = inbox_->arrive(peer_, env);
  }
  const bool keep = landing.data != nullptr && landing.capacity >= env.nbytes;
  try {
    readInto(landing.data, env.nbytes, keep);
  } catch (const std::exception& e) {
    // The landing's owner must hear about the failure (Landing::done runs exactly once).
    if (landing.done) landing.done(makeError(peer_, e.what()));
    throw;
  }
  if (landing.done) landing.done(nullptr);
}

void StreamPair::rxLoop() {
  try {
    while (true) {
      Frame frame;
      if (!readAll(fd_.get(), &frame, sizeof(frame), peer_, config_.name, /*eofOk=*/true)) {
        bool goodbye;
        {
          std::lock_guard<std::mutex> lock(mu_);
          goodbye = peerSaidGoodbye_;
        }
        fail(std::string(config_.name) + ": connection to rank " + std::to_string(peer_) +
                 (goodbye ? " closed: that rank shut down its process group"
                          : " closed by the peer (EOF; did that process exit or crash?)"),
             goodbye);
        return;
      }
      switch (frame.kind) {
        case kInline:
        case kRemote:
        case kRts:
        case kData:
          receivePayload(frame);
          break;
        case kCts: {
          bool found = false;
          {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = awaitingCts_.find(frame.seq);
            if (it != awaitingCts_.end()) {
              queue_.push_back(std::move(it->second));
              awaitingCts_.erase(it);
              found = true;
            }
          }
          if (found) cv_.notify_one();
          break;
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
                     : makeError(peer_, std::string(config_.name) + ": rank " +
                                            std::to_string(peer_) +
                                            " could not read the message from this process: " +
                                            errnoString(frame.status)));
          }
          break;
        }
        case kGoodbye: {
          std::lock_guard<std::mutex> lock(mu_);
          peerSaidGoodbye_ = true;
          break;
        }
        default:
          fail(std::string(config_.name) + ": protocol error from rank " + std::to_string(peer_) +
               ": unknown frame kind " + std::to_string(frame.kind));
          return;
      }
    }
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void StreamPair::fail(const std::string& cause, bool cleanClose) {
  std::deque<Outgoing> queued;
  std::map<uint64_t, SendDone> awaiting;
  std::vector<Landing> landings;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_ || closing_) return;
    failed_ = true;
    failure_ = cause;
    queued.swap(queue_);
    awaiting.swap(awaitingAck_);
    for (auto& kv : awaitingCts_) queued.push_back(std::move(kv.second));
    awaitingCts_.clear();
    for (auto& kv : rendezvousLanding_) landings.push_back(std::move(kv.second));
    rendezvousLanding_.clear();
  }
  cv_.notify_all();
  ::shutdown(fd_.get(), SHUT_RDWR);  // wakes the other thread of this pair
  auto err = makeError(peer_, cause);
  for (auto& out : queued) {
    if (out.done) out.done(err);
  }
  for (auto& kv : awaiting) kv.second(err);
  for (auto& l : landings) {
    if (l.done) l.done(err);
  }
  if (cleanClose) {
    inbox_->peerClosed(peer_, cause);
  } else {
    inbox_->peerFailed(peer_, cause);
  }
}

void StreamPair::close() {
  std::deque<Outgoing> queued;
  std::map<uint64_t, SendDone> awaiting;
  std::vector<Landing> landings;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closing_) return;
    if (!failed_) {
      // Let the queue drain briefly so the peer gets what was already sent, then say goodbye.
      auto until = Clock::now() + std::chrono::seconds(2);
      while ((!queue_.empty() || txWriting_) && Clock::now() < until) {
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        lock.lock();
      }
      if (queue_.empty() && !txWriting_) {
        Outgoing bye;
        bye.frame.kind = kGoodbye;
        try {
          writeFrame(bye);
        } catch (const std::exception&) {
        }
      }
    }
    closing_ = true;
    queued.swap(queue_);
    awaiting.swap(awaitingAck_);
    for (auto& kv : awaitingCts_) queued.push_back(std::move(kv.second));
    awaitingCts_.clear();
    for (auto& kv : rendezvousLanding_) landings.push_back(std::move(kv.second));
    rendezvousLanding_.clear();
  }
  cv_.notify_all();
  ::shutdown(fd_.get(), SHUT_RDWR);
  if (rx_.joinable() && rx_.get_id() != std::this_thread::get_id()) rx_.join();
  if (tx_.joinable() && tx_.get_id() != std::this_thread::get_id()) tx_.join();
  if (rx_.joinable()) rx_.detach();
  if (tx_.joinable()) tx_.detach();
  auto err = makeError(peer_, std::string(config_.name) + ": pair to rank " +
                                  std::to_string(peer_) + " closed locally");
  for (auto& out : queued) {
    if (out.done) out.done(err);
  }
  for (auto& kv : awaiting) kv.second(err);
  for (auto& l : landings) {
    if (l.done) l.done(err);
  }
}

// ---- StreamTransport ----------------------------------------------------------------------

std::string StreamTransport::addressKey(int rank) const {
  return ctx_.keyPrefix + config_.name + "/addr/" + std::to_string(rank);
}

void StreamTransport::start(const TransportContext& context) {
  ctx_ = context;
  if (config_.tcp) {
    listener_ = listenTcp(ctx_.listenHost);
  } else {
    // Let sibling processes (same user) read this process's memory under Yama ptrace_scope=1.
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    char name[96];
    snprintf(name, sizeof(name), "dicomm-%d-%p-%d", getpid(), static_cast<void*>(this),
             ctx_.rank);
    listener_ = listenUnix(name);
  }
  const std::string& a = listener_.address;
  ctx_.store->set(addressKey(ctx_.rank), std::vector<uint8_t>(a.begin(), a.end()));
}

std::unique_ptr<Pair> StreamTransport::connect(int peer) {
  const auto deadline = Clock::now() + ctx_.timeout;
  const char* name = config_.name;
  Hello mine;
  mine.magic = kHelloMagic;
  mine.rank = ctx_.rank;
  mine.pid = getpid();
  mine.probe = reinterpret_cast<uint64_t>(&kProbeWord);
  std::copy_n(ctx_.authKey.begin(), std::min<size_t>(ctx_.authKey.size(), sizeof(mine.key)),
              mine.key);
  auto keyOk = [&](const Hello& h) {
    return h.magic == kHelloMagic && memcmp(h.key, mine.key, sizeof(mine.key)) == 0;
  };

  Fd fd;
  Hello theirs;
  if (ctx_.rank < peer) {
    // The lower rank dials; the higher rank accepts.
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
    fd = dial(std::string(bytes.begin(), bytes.end()), deadline, peer);
    writeAll(fd.get(), &mine, sizeof(mine), peer, name);
    readAllUntil(fd.get(), &theirs, sizeof(theirs), deadline, peer, name);
    if (!keyOk(theirs) || theirs.rank != peer) {
      throw TransportError(peer, std::string("dicomm ") + name + ": rank " +
                                     std::to_string(peer) + " failed authentication");
    }
  } else {
    std::unique_lock<std::mutex> lock(acceptMu_);
    while (true) {
      auto it = accepted_.find(peer);
      if (it != accepted_.end()) {
        fd = std::move(it->second.first);
        theirs = it->second.second;
        accepted_.erase(it);
        break;
      }
      Fd c = acceptUntil(listener_.fd.get(), deadline);
      if (!c) {
        throw TransportError(peer, std::string("dicomm ") + name + ": rank " +
                                       std::to_string(peer) + " did not connect within " +
                                       std::to_string(ctx_.timeout.count()) +
                                       " ms (did it join the process group?)");
      }
      Hello h;
      try {
        readAllUntil(c.get(), &h, sizeof(h), std::min(deadline, Clock::now() + std::chrono::seconds(10)),
                     -1, name);
      } catch (const std::exception&) {
        continue;  // a stray or slow client: drop it
      }
      if (!keyOk(h) || h.rank < 0 || h.rank >= ctx_.size) continue;  // not one of ours: drop
      writeAll(c.get(), &mine, sizeof(mine), h.rank, name);
      accepted_[h.rank] = {std::move(c), h};
    }
  }
  tuneSocket(fd.get(), config_.tcp);

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
  return std::make_unique<StreamPair>(peer, std::move(fd), ctx_.inbox, config_, theirs.pid,
                                      remoteOk);
}

}  // namespace dicomm
