// A same-host pair's small-frame ring: one direction of an shm pair's small messages through
// shared memory instead of the socket, so a waiter that polls sees a message with a load, not a
// system call, and the sender writes it with a copy, not a system call.
//
// The reading process creates the ring (a memfd) and offers it over the pair's socket; the
// writing process opens it through /proc/<pid>/fd (the same same-user access cross-memory
// attach needs, checked at connect time) and maps it. One writer (the thread that holds the
// pair's main lane) and one reader (the thread that holds its reading lock) at a time.
//
// The reader says whether it polls: `awake` while a waiting thread polls the ring, `away`
// otherwise (it sleeps on the socket, or nobody waits). The writer publishes only to an awake
// reader, and after publishing looks again: if the reader went away meanwhile, publish() says
// kPublishedWake and the writer rings a bell the sleeper wakes for (a frame on the socket).
// The reader, on its way out, marks itself away and then looks at the ring once more. Both
// sides store, then load the other's word (sequentially consistent), so at least one of them
// sees the other: a message is either seen by the reader's last look or announced by a bell,
// never left in the ring unannounced (tests/comm/unit/ring_handshake.cpp runs this handshake
// thousands of times).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace dicomm {

class SmallFrameRing {
 public:
  static constexpr size_t kHeaderBytes = 64;  // one frame header (StreamPair::Frame) per slot
  static constexpr size_t kSlotBytes = 1024;
  static constexpr size_t kPayloadMax = kSlotBytes - kHeaderBytes;
  static constexpr uint64_t kSlots = 64;
  static size_t bytes();  // of the whole mapping

  // The reader's side: a new ring in a memfd of this process; null (with `why`) on failure.
  static std::unique_ptr<SmallFrameRing> create(std::string* why);
  // The writer's side: the ring behind descriptor `fd` of process `pid`; null (with `why`)
  // when it cannot be opened or is not a ring of this layout (size, magic).
  static std::unique_ptr<SmallFrameRing> openPeer(pid_t pid, int fd, std::string* why);
  ~SmallFrameRing();
  SmallFrameRing(const SmallFrameRing&) = delete;
  SmallFrameRing& operator=(const SmallFrameRing&) = delete;
  int fd() const { return fd_; }  // the creator's descriptor (what it offers); -1 for a writer

  // Writer. kReaderAway / kFull: nothing was published (send it another way).
  enum class Put { kReaderAway, kFull, kPublished, kPublishedWake };
  Put publish(const void* header, const void* payload, size_t n);

  // Reader.
  void setAwake();
  // After it, the caller looks at the ring once more (peek) before it sleeps or leaves.
  void setAway();
  // The oldest unread slot (its header; the payload follows at kHeaderBytes), or null when
  // empty. Sets `corrupt` when the writer's count is ahead by more than the ring holds.
  const char* peek(bool* corrupt) const;
  bool pending() const;  // something to peek (one load; for a poller's pause)
  void consume();  // done with the slot peek() returned

 private:
  struct Control;
  SmallFrameRing(char* base, int fd);
  Control& control() const;
  char* slot(uint64_t index) const;
  char* base_;
  int fd_;
};

}  // namespace dicomm
