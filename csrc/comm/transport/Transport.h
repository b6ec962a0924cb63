// The transport interface of DiComm: how bytes move between two ranks.
//
// The backend core (matching, collectives, staging, faults) is written against this header only.
// A transport supplies, per backend instance, a `Transport` object that connects to peers
// through the c10d store and yields one `Pair` per peer. A pair is a reliable, ordered,
// message-oriented channel: every message is an `Envelope` (tag, size, dtype) followed by
// `nbytes` of payload. The sending side hands a pointer to `Pair::send`; the receiving side's
// transport asks the core's `Inbox` where the payload of each arriving envelope must land
// (a posted receive buffer, or a fresh buffer for an unexpected message) and reports completion.
//
// Built-in transports: tcp (any peers), shm (same-host peers, cross-memory attach). The rdma
// transport (csrc/comm/transport/rdma/) is compiled only when libibverbs is found.
//
// Rules every transport follows:
//  - messages on one pair arrive in the order they were sent;
//  - `Inbox::arrive` is called once per message, before any payload byte is written;
//  - the `Landing::done` / `SendDone` callbacks run exactly once, on any thread, and must not
//    be called with transport locks held that the core may need (the core may call `send`
//    from inside a completion callback);
//  - every error names the peer rank and the cause, e.g. "tcp: connection to rank 3 lost: EOF";
//  - when a pair breaks, pending sends complete with an error and the transport calls
//    `Inbox::peerFailed(peer, cause)` once; the cause is `Inbox::abortNotice(peer)` when the
//    peer said why it aborted;
//  - a pair is shared: its own threads hold it until they exit, so a completion callback may
//    close it and drop every other reference (destroy the process group) on the pair's own
//    thread; once close() has returned the pair never calls its Inbox again.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/transport/ListenAddress.h"

namespace dicomm {

// What precedes every message on the wire (after a transport's own framing, if any).
struct Envelope {
  uint64_t tag = 0;     // who the message is for: see csrc/comm/core/Tags.h
  uint64_t nbytes = 0;  // payload size
  int32_t dtype = -1;   // c10::ScalarType of the payload, -1 if untyped
  uint32_t flags = 0;   // reserved for transports' use (e.g. rendezvous protocol); core ignores
};
static_assert(sizeof(Envelope) == 24, "Envelope is a wire format");

// Memory a transport reads from or writes to.
enum class MemoryKind : uint8_t {
  kHost = 0,    // ordinary (possibly pinned) host memory
  kDevice = 1,  // accelerator memory (only for a pair whose canAccessDevice() is true)
};

// Where an arriving message's payload goes; produced by the core's Inbox.
struct Landing {
  // Destination of the payload. nullptr: the core already rejected the message (e.g. a size or
  // dtype mismatch, reported to the waiting op); the transport must consume and drop the payload
  // so the stream stays in sync, then still call `done`.
  void* data = nullptr;
  // Bytes the destination can hold; the core guarantees capacity >= envelope.nbytes when
  // data != nullptr (a transport never writes more than capacity).
  size_t capacity = 0;
  MemoryKind memory = MemoryKind::kHost;
  // Called once the payload is fully in `data` (nullptr) or the transfer failed (the error).
  std::function<void(std::exception_ptr)> done;
};

// The receiving half of the core, as a transport sees it.
class Inbox {
 public:
  virtual ~Inbox() = default;
  // A message from `peer` arrived; returns where its payload goes. Called on the transport's
  // receive thread, in arrival order per pair. Never blocks on other messages.
  virtual Landing arrive(int peer, const Envelope& envelope) = 0;
  // Rendezvous variant, for a payload that can wait on the sender's side (shm cross-memory
  // attach, tcp request-to-send, an RDMA read): `ready` runs exactly once with the landing as
  // soon as a receive matches -- during this call (on the transport's thread) when one is
  // already posted, otherwise later, on the thread that posts the matching receive. This avoids
  // the bounce buffer and extra copy of an unexpected message. `ready` is dropped (never run)
  // if the communicator closes first. The default matches at once, like arrive().
  virtual void arriveWhenPosted(int peer, const Envelope& envelope,
                                std::function<void(Landing)> ready) {
    ready(arrive(peer, envelope));
  }
  // The pair to `peer` broke (peer died, socket error, protocol error). Every op waiting on that
  // peer fails with `cause`. Called at most once per pair, not during a local close().
  virtual void peerFailed(int peer, const std::string& cause) = 0;
  // The peer closed the pair cleanly (it shut down its process group) after everything it sent
  // arrived: messages already delivered stay receivable, receives that can no longer be
  // satisfied fail with `cause`. Not an abort. Default: treat as a failure.
  virtual void peerClosed(int peer, const std::string& cause) { peerFailed(peer, cause); }
  // Why `peer` aborted, if it sent word of it before closing (empty otherwise). A transport
  // whose pair then breaks reports this instead of the connection loss, which is only its
  // consequence: "rank 0 aborted its process group: rank 2 died" beats "rank 0 closed".
  virtual std::string abortNotice(int peer) {
    (void)peer;
    return {};
  }
};

using SendDone = std::function<void(std::exception_ptr)>;

// A connection to one peer.
class Pair {
 public:
  virtual ~Pair() = default;
  virtual int peer() const = 0;
  virtual const char* transportName() const = 0;
  // Whether send/Landing may point at device memory of `deviceType` (a c10::DeviceType value).
  // tcp/shm: never (the core stages device tensors through host buffers unless the device's
  // memory is host-addressable, in which case it passes MemoryKind::kHost pointers).
  virtual bool canAccessDevice(int deviceType) const {
    (void)deviceType;
    return false;
  }
  // Connections this pair stripes large payloads over (1 for most transports).
  virtual int connections() const { return 1; }
  // The TCP congestion control of its connections ("" for transports that are not TCP).
  virtual std::string congestion() const { return ""; }
  // Receive and handle the peer's messages on the calling thread until `done` is set or `until`
  // passes. A thread about to wait for this peer's message reads it itself instead of being
  // woken by the transport's receive thread: on a VM a wake-up costs more than a small
  // message's whole trip. Returns false at once, doing nothing, when another thread is reading,
  // the pair is down, or the transport has no such path; the caller then just waits.
  // `block`: between frames, sleep in the kernel on the connection instead of polling it (a busy
  // host): the thread then wakes once, on the peer's frame, instead of the receive thread waking
  // and then waking it.
  virtual bool progress(const std::atomic<bool>& done,
                        std::chrono::steady_clock::time_point until, bool block = false) {
    (void)done;
    (void)until;
    (void)block;
    return false;
  }
  // A progress() that completed its op may leave the transport's own receive thread parked for
  // a moment, expecting the caller back for the next message; a frame that nobody polls for is
  // then handled late, though within a bound the transport keeps (tcp/shm: 1 ms). unpark() hands
  // reading back to the transport now: called before waiting on this peer without polling.
  virtual void unpark() {}
  // Queue `envelope` + `envelope.nbytes` bytes at `data` for the peer. `data` stays valid and
  // unchanged until `done` runs. Thread-safe; messages leave in the order send() was called.
  virtual void send(const Envelope& envelope, const void* data, MemoryKind memory,
                    SendDone done) = 0;
  // Stop threads and release the connection. Pending sends complete with an error that says the
  // pair was closed locally; Inbox::peerFailed is not called. Idempotent.
  virtual void close() = 0;
};

// What a transport needs to connect the ranks of one process group.
struct TransportContext {
  c10::intrusive_ptr<c10d::Store> store;  // the group's (prefixed) store
  std::string keyPrefix;                  // prepend to every store key this transport uses
  int rank = 0;
  int size = 0;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  Inbox* inbox = nullptr;                 // outlives every Pair
  ListenAddress listen;                   // where stream listeners bind (see ListenAddress.h)
  std::vector<uint8_t> authKey;           // shared secret peers must prove (from the store)
  int localRanks = 1;                     // ranks of this group on this host, this one included
};

// One transport instance per process group. Typical lifetime:
//   start(ctx)  -> open listeners, publish this rank's address under ctx.keyPrefix in the store
//   connect(p)  -> for every peer p chosen to use this transport (both ranks of a pair call
//                  connect for each other, in any order); blocks up to ctx.timeout and throws
//                  std::runtime_error naming the peer if it never shows up
//   ~Transport  -> after every Pair was closed
class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  virtual void start(const TransportContext& context) = 0;
  virtual std::shared_ptr<Pair> connect(int peer) = 0;
};

// Error thrown/reported by transports; what() names the peer.
class TransportError : public std::runtime_error {
 public:
  TransportError(int peer, const std::string& what) : std::runtime_error(what), peer_(peer) {}
  int peer() const { return peer_; }

 private:
  int peer_;
};

// ---- registry ----------------------------------------------------------------------------------

struct TransportFactory {
  // Whether this transport can run on this machine (e.g. a verbs device exists). Cheap, cached
  // by the caller. A transport that is built but not usable is never chosen by `auto` and is an
  // error when forced with DICOMM_TRANSPORT.
  std::function<bool()> usable;
  // Whether two ranks described by their host ids can use this transport with each other
  // (shm: same host; tcp/rdma: always).
  std::function<bool(const std::string& myHost, const std::string& peerHost)> reaches;
  std::function<std::unique_ptr<Transport>()> create;
  // Lower is preferred by `auto` (rdma 10, shm 20, tcp 30).
  int preference = 100;
};

// Name -> factory for every transport compiled into this module.
std::map<std::string, TransportFactory>& transportRegistry();

struct TransportRegistrar {
  TransportRegistrar(const std::string& name, TransportFactory factory) {
    transportRegistry()[name] = std::move(factory);
  }
};

}  // namespace dicomm

// DICOMM_REGISTER_TRANSPORT(rdma, makeRdmaFactory()) in a transport's .cpp registers it at load.
#define DICOMM_REGISTER_TRANSPORT(name, factory)                                    \
  static ::dicomm::TransportRegistrar dicomm_transport_registrar_##name(#name, (factory))
