// Timestamps along one point-to-point send and one receive, for finding where a small message's
// time goes (benchmarks/comm.py --breakdown). Off unless DICOMM_TRACE=1: then each mark is one
// clock read and one store into a process-wide slot per point (the latest op's mark wins, so
// the caller takes them after each op of a ping-pong). Off, a mark is one load of a flag.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dicomm {
namespace trace {

enum Point : int {
  kSendCall,     // the backend's send() entered
  kSendPosted,   // Work made and host view taken: the communicator's isend() is called
  kSendWritten,  // the frame is on the wire (written to the socket, or published in the ring)
  kSendWaitIn,   // Work::wait() entered
  kSendWaitOut,  // Work::wait() returns
  kRecvCall,     // the backend's recv() entered
  kRecvPosted,   // the receive is posted in the mailbox
  kRecvWaitIn,   // Work::wait() entered
  kRecvFrame,    // the message's header was read by this process (any thread)
  kRecvLanded,   // its payload is in place (the completion runs)
  kRecvWaitOut,  // Work::wait() returns
  kWaitBlocks,   // a wait (any op) stopped polling and sleeps on its peer's connection
  kPoints
};

// Whether DICOMM_TRACE=1 (read once).
bool enabled();

namespace detail {
extern std::atomic<int64_t> stamps[kPoints];
int64_t nowNs();
}  // namespace detail

// Records CLOCK_MONOTONIC nanoseconds (the clock of Python's time.perf_counter) for `p`.
inline void mark(Point p) {
  if (enabled()) detail::stamps[p].store(detail::nowNs(), std::memory_order_relaxed);
}

// Every point's name and its last stamp (0: not reached since the last take), then clears them.
std::vector<std::pair<std::string, int64_t>> take();

}  // namespace trace
}  // namespace dicomm
