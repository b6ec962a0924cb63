// Stream-socket helpers shared by the tcp and shm transports: listen, dial with retry, and
// exact reads/writes that report the peer on failure.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dicomm {

using Clock = std::chrono::steady_clock;

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset();
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Address a listener publishes: "tcp:<ip>:<port>" or "unix:<abstract name>".
struct Listener {
  Fd fd;
  std::string address;
};

Listener listenTcp(const std::string& host);
Listener listenUnix(const std::string& name);  // abstract-namespace AF_UNIX socket

// Dial `address` (as published by a Listener), retrying refused or unanswered connections until
// `deadline`. Throws TransportError "cannot connect to rank <peer> at <address>: <errno>".
Fd dial(const std::string& address, Clock::time_point deadline, int peer);

// Tune a connected socket: TCP_NODELAY; `bufferBytes` > 0 fixes the kernel buffers (which turns
// off their auto-tuning; on loopback, buffers larger than the cache slow a stream down); a
// non-empty `congestion` sets the TCP congestion control; `peerTimeoutS` > 0 turns on keepalive
// and TCP_USER_TIMEOUT so that a peer host that stopped answering fails the socket in that time.
void tuneSocket(int fd, bool tcp, int bufferBytes, const std::string& congestion,
                int peerTimeoutS);

// The TCP congestion control of connected socket `fd` ("" if it has none: not TCP).
std::string congestionControl(int fd);
// 0 if this process may set `algorithm` on a TCP socket, else the errno the kernel refuses with
// (ENOENT: not available, EPERM: not in net.ipv4.tcp_allowed_congestion_control).
int congestionAllowed(const std::string& algorithm);
// Whether both ends of connected TCP socket `fd` are on this host: the peer is a loopback
// address or the very address this end has.
bool hostLocal(int fd);

// Exact I/O. Throw TransportError naming `peer` and the errno / EOF.
void writeAll(int fd, const void* data, size_t n, int peer, const char* transport);
void writevAll(int fd, struct iovec* iov, int iovcnt, int peer, const char* transport);
// Returns false on a clean EOF before the first byte when `eofOk`; throws otherwise.
bool readAll(int fd, void* data, size_t n, int peer, const char* transport, bool eofOk = false);

// Whether a read of `fd` would not block now (data, EOF or an error is waiting).
bool readableNow(int fd);

// How a lost connection is reported, the same from every reader: "connection to rank 3 closed
// by the peer (EOF; ...)" and "connection to rank 3 broke: <errno>".
std::string eofCause(int peer);
std::string brokeCause(int peer, int err);

// Read with a deadline (used only during connection set-up); throws on timeout.
void readAllUntil(int fd, void* data, size_t n, Clock::time_point deadline, int peer,
                  const char* transport);

std::string errnoString(int err);

}  // namespace dicomm
