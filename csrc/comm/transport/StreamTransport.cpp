#include "comm/transport/StreamTransport.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/transport/CrossMemory.h"
#include "comm/transport/Env.h"
#include "comm/transport/Log.h"
#include "comm/transport/StreamPair.h"

namespace dicomm {

StreamTransport::StreamTransport(StreamConfig config) : config_(config) {}

StreamTransport::~StreamTransport() = default;

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
      std::vector<uint8_t> why;
      try {
        given = ctx_.store->check({unreachableKey(ctx_.rank)});
        if (given) why = ctx_.store->get(unreachableKey(ctx_.rank));
      } catch (const std::exception& e) {
        // The store's host (often rank 0 itself) went away, possibly right after it wrote why:
        // its rank failed first.
        throw TransportError(peer, std::string("dicomm ") + name + ": rank " +
                                       std::to_string(peer) + " did not connect, and the store " +
                                       "stopped answering meanwhile (did the rank hosting it fail? " +
                                       "see its error): " + e.what());
      }
      if (given) {
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
  const bool listening = Clock::now() >= acceptRestUntil_;
  std::vector<pollfd> fds{{listening ? listener_.fd.get() : -1, POLLIN, 0}};
  for (auto& g : greeting_) fds.push_back({g.fd.get(), POLLIN, 0});
  auto soonest = listening ? until : std::min(until, acceptRestUntil_);
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
  const auto now = Clock::now();
  greeting_.erase(std::remove_if(greeting_.begin(), greeting_.end(),
                                 [&](const Greeting& g) { return !g.fd || g.deadline <= now; }),
                  greeting_.end());
  if (n > 0 && listening && (fds[0].revents & POLLIN)) {
    const size_t before = greeting_.size();
    acceptOne();
    progressed = progressed || greeting_.size() != before;
  }
  return progressed;
}

void StreamTransport::acceptOne() {
  while (greeting_.size() >= maxGreetings()) evictOldestGreeting();
  const int c = ::accept4(listener_.fd.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (c >= 0) {
    greeting_.push_back(Greeting{});
    greeting_.back().fd = Fd(c);
    greeting_.back().deadline = Clock::now() + kHelloWindow;
    acceptRest_ = std::chrono::milliseconds(0);
    if (greetingBound_.lowered()) greetingBound_.accepted(groupGreetings(), freeDescriptors());
    return;
  }
  const int err = errno;
  if (err != EMFILE && err != ENFILE && err != ENOBUFS && err != ENOMEM) return;  // e.g. the dialer gave up
  if (!greeting_.empty()) {
    greetingBound_.exhausted(greeting_.size());
    while (greeting_.size() > maxGreetings() - 1) evictOldestGreeting();  // their descriptors are free again
    return;
  }
  // Nothing of ours to free: rest instead of polling a listener whose connection cannot be taken.
  acceptRest_ = std::min(kAcceptRestMax, std::max(kAcceptRest, acceptRest_ * 2));
  acceptRestUntil_ = Clock::now() + acceptRest_;
  logLine(LogLevel::kWarn, std::string(config_.name) + ": rank " + std::to_string(ctx_.rank) +
                               " cannot accept a connection (" + errnoString(err) + "); retrying in " +
                               std::to_string(acceptRest_.count()) + " ms");
}

void StreamTransport::evictOldestGreeting() {
  auto oldest = std::min_element(greeting_.begin(), greeting_.end(),
                                 [](const Greeting& a, const Greeting& b) { return a.deadline < b.deadline; });
  if (oldest == greeting_.end()) return;
  greeting_.erase(oldest);
  if (++evicted_ % 64 == 1) {
    logLine(LogLevel::kWarn, std::string(config_.name) + ": rank " + std::to_string(ctx_.rank) +
                                 " dropped an unauthenticated connection for room (" + std::to_string(evicted_) +
                                 " so far): more connections than any group needs are being opened to it");
  }
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
  mine.probe = probeAddress();
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
    uint8_t canRead = probeReads(theirs.pid, theirs.probe);
    uint8_t peerCanRead = 0;
    writeAll(fd.get(), &canRead, 1, peer, name);
    readAllUntil(fd.get(), &peerCanRead, 1, deadline, peer, name);
    remoteOk = canRead && peerCanRead;
  }
  return StreamPair::start(peer, std::move(fds), ctx_.inbox, config_, theirs.pid, remoteOk);
}

}  // namespace dicomm
