#include "comm/transport/Socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <net/if.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "comm/transport/ListenAddress.h"
#include "comm/transport/Transport.h"

namespace dicomm {

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = o.release();
  }
  return *this;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string errnoString(int err) {
  char buf[128];
  // GNU strerror_r returns the message pointer.
  const char* msg = strerror_r(err, buf, sizeof(buf));
  return std::string(msg) + " (errno " + std::to_string(err) + ")";
}

static void fail(int peer, const char* transport, const std::string& what) {
  throw TransportError(peer, std::string(transport) + ": " + what);
}

Listener listenTcp(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), "0", &hints, &res);
  if (rc != 0) {
    throw std::runtime_error("dicomm tcp: cannot resolve listen host '" + host +
                             "': " + gai_strerror(rc));
  }
  Listener l;
  std::string lastError = "no address";
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0));
    if (!fd) continue;
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), 128) != 0) {
      lastError = errnoString(errno);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    char ip[INET6_ADDRSTRLEN] = {0};
    int port = 0;
    std::string published;
    if (ss.ss_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&ss);
      inet_ntop(AF_INET, &a->sin_addr, ip, sizeof(ip));
      port = ntohs(a->sin_port);
      published = ip;
    } else {
      auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
      inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof(ip));
      port = ntohs(a->sin6_port);
      published = ip;
      char scope[IF_NAMESIZE] = {0};
      if (a->sin6_scope_id != 0 && if_indextoname(a->sin6_scope_id, scope)) {
        published += std::string("%") + scope;  // link-local: the peer swaps in its own interface
      }
    }
    l.fd = std::move(fd);
    l.address = joinTcpAddress(published, port);
    break;
  }
  freeaddrinfo(res);
  if (!l.fd) {
    throw std::runtime_error("dicomm tcp: cannot listen on '" + host + "': " + lastError);
  }
  return l;
}

Listener listenUnix(const std::string& name) {
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw std::runtime_error("dicomm shm: socket(AF_UNIX): " + errnoString(errno));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  // Abstract namespace: nothing on disk to clean up; name is unique per rank and group.
  if (name.size() + 1 >= sizeof(addr.sun_path)) {
    throw std::runtime_error("dicomm shm: socket name too long: " + name);
  }
  memcpy(addr.sun_path + 1, name.data(), name.size());
  socklen_t len = offsetof(sockaddr_un, sun_path) + 1 + name.size();
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::listen(fd.get(), 128) != 0) {
    throw std::runtime_error("dicomm shm: cannot listen on @" + name + ": " + errnoString(errno));
  }
  return Listener{std::move(fd), "unix:" + name};
}

static Fd dialOnce(const std::string& address, int attemptMs, int* err) {
  if (address.rfind("unix:", 0) == 0) {
    std::string name = address.substr(5);
    Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path + 1, name.data(), std::min(name.size(), sizeof(addr.sun_path) - 2));
    socklen_t len = offsetof(sockaddr_un, sun_path) + 1 + name.size();
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      *err = errno;
      return Fd();
    }
    return fd;
  }
  std::string host, port;
  if (!splitTcpAddress(address, &host, &port)) {
    throw std::runtime_error("dicomm: bad peer address '" + address + "'");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || !res) {
    throw std::runtime_error("dicomm: bad peer address '" + address + "'");
  }
  // Non-blocking, so that an unreachable host (SYNs dropped) costs `attemptMs`, not the
  // kernel's two minutes of SYN retries.
  Fd fd(::socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  int rc = ::connect(fd.get(), res->ai_addr, res->ai_addrlen);
  *err = rc == 0 ? 0 : errno;
  freeaddrinfo(res);
  if (rc != 0 && *err == EINPROGRESS) {
    pollfd p{fd.get(), POLLOUT, 0};
    rc = ::poll(&p, 1, attemptMs);
    if (rc == 0) {
      *err = ETIMEDOUT;
      return Fd();
    }
    int soErr = 0;
    socklen_t len = sizeof(soErr);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &soErr, &len);
    *err = rc < 0 ? errno : soErr;
    if (*err != 0) return Fd();
  } else if (rc != 0) {
    return Fd();
  }
  const int flags = fcntl(fd.get(), F_GETFL);
  fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

Fd dial(const std::string& address, Clock::time_point deadline, int peer) {
  int err = 0;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    Fd fd = dialOnce(address, static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(left.count(), 1000))),
                     &err);
    if (fd) return fd;
    if (Clock::now() >= deadline) {
      throw TransportError(peer, "cannot connect to rank " + std::to_string(peer) + " at " +
                                     address + ": " + errnoString(err));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void tuneSocket(int fd, bool tcp, int bufferBytes, const std::string& congestion,
                int peerTimeoutS) {
  int one = 1;
  if (tcp) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (tcp && peerTimeoutS > 0) {
    // A host that vanishes (power, link, partition) sends no FIN or RST: only these notice it.
    // Keepalive probes an idle connection every peerTimeoutS/4 s; TCP_USER_TIMEOUT fails the
    // socket once sent data (or probes) stay unacknowledged for peerTimeoutS.
    const int idle = std::max(1, peerTimeoutS / 4), count = 4;
    const unsigned userTimeoutMs = static_cast<unsigned>(peerTimeoutS) * 1000u;
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &idle, sizeof(idle));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &userTimeoutMs, sizeof(userTimeoutMs));
  }
  if (tcp && !congestion.empty()) {
    setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, congestion.data(), congestion.size());
  }
  if (bufferBytes > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufferBytes, sizeof(bufferBytes));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bufferBytes, sizeof(bufferBytes));
  }
}

std::string congestionControl(int fd) {
  char name[64] = {0};
  socklen_t len = sizeof(name) - 1;
  if (getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) return "";
  return std::string(name, strnlen(name, len));
}

int congestionAllowed(const std::string& algorithm) {
  Fd probe(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!probe) return errno;
  if (setsockopt(probe.get(), IPPROTO_TCP, TCP_CONGESTION, algorithm.data(), algorithm.size()) != 0) {
    return errno;
  }
  return 0;
}

bool hostLocal(int fd) {
  sockaddr_storage mine{}, theirs{};
  socklen_t myLen = sizeof(mine), theirLen = sizeof(theirs);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &myLen) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &theirLen) != 0 ||
      mine.ss_family != theirs.ss_family) {
    return false;
  }
  if (theirs.ss_family == AF_INET) {
    const in_addr a = reinterpret_cast<const sockaddr_in&>(mine).sin_addr;
    const in_addr b = reinterpret_cast<const sockaddr_in&>(theirs).sin_addr;
    return (ntohl(b.s_addr) >> 24) == 127 || a.s_addr == b.s_addr;
  }
  if (theirs.ss_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6&>(mine).sin6_addr;
    const in6_addr& b = reinterpret_cast<const sockaddr_in6&>(theirs).sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(&b) || std::memcmp(&a, &b, sizeof(a)) == 0;
  }
  return false;
}

void writeAll(int fd, const void* data, size_t n, int peer, const char* transport) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      fail(peer, transport,
           "send to rank " + std::to_string(peer) + " failed: " + errnoString(errno));
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void writevAll(int fd, struct iovec* iov, int iovcnt, int peer, const char* transport) {
  while (iovcnt > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = iovcnt;
    ssize_t k = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      fail(peer, transport,
           "send to rank " + std::to_string(peer) + " failed: " + errnoString(errno));
    }
    size_t left = static_cast<size_t>(k);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
}

bool readAll(int fd, void* data, size_t n, int peer, const char* transport, bool eofOk) {
  char* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < n) {
    ssize_t k = ::recv(fd, p + got, n - got, MSG_WAITALL);
    if (k == 0) {
      if (eofOk && got == 0) return false;
      fail(peer, transport, eofCause(peer));
    }
    if (k < 0) {
      if (errno == EINTR) continue;
      fail(peer, transport, brokeCause(peer, errno));
    }
    got += static_cast<size_t>(k);
  }
  return true;
}

std::string eofCause(int peer) {
  return "connection to rank " + std::to_string(peer) +
         " closed by the peer (EOF; did that process exit or crash?)";
}

std::string brokeCause(int peer, int err) {
  std::string cause = "connection to rank " + std::to_string(peer) + " broke: " + errnoString(err);
  if (err == ETIMEDOUT) {
    cause += " (its host stopped answering for DICOMM_PEER_TIMEOUT seconds: down, or cut off)";
  }
  return cause;
}

bool readableNow(int fd) {
  pollfd pf{fd, POLLIN, 0};
  return ::poll(&pf, 1, 0) > 0;
}

void readAllUntil(int fd, void* data, size_t n, Clock::time_point deadline, int peer,
                  const char* transport) {
  char* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < n) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      fail(peer, transport, "timed out reading the handshake of rank " + std::to_string(peer));
    }
    pollfd pf{fd, POLLIN, 0};
    if (::poll(&pf, 1, static_cast<int>(left.count())) <= 0) continue;
    ssize_t k = ::recv(fd, p + got, n - got, 0);
    if (k == 0) fail(peer, transport, "peer closed the connection during the handshake");
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      fail(peer, transport, "handshake read failed: " + errnoString(errno));
    }
    got += static_cast<size_t>(k);
  }
}

}  // namespace dicomm
