// An allreduce among the ranks of one host through one shared-memory segment they all map,
// instead of a ring of copies from rank to rank.
//
// The payload goes through the segment in rounds of one chunk (kChunkBytes, small enough that
// the segment stays in the cores' caches): every rank copies into its own slot the parts of its
// chunk that the others reduce; once all have, rank i reduces the i-th n-th in place in its own
// buffer (its input, then every other slot's part i) and publishes it in its slot; once all
// have, every rank copies the other parts out into its buffer. Memory traffic per rank is one
// read of its input and one write of its output, as a memcpy; the slots in between stay in
// cache, where a ring moves each byte through memory once per hop and hands every chunk between
// threads. Each part is reduced by one rank in a fixed order, so every rank gets the same bits.
//
// Synchronisation is one 32-bit counter per rank ("stage"), advanced twice per round: after its
// copy-in (2t+1 in round t) and after its reduction (2t+2). Invariants:
//   S1 a rank reduces round t only once every stage >= 2t+1 (every slot holds round t's chunk);
//   S2 a rank copies out round t only once every stage >= 2t+2 (every part is reduced);
//   S3 rounds alternate between two sets of slots, and by S2 of round t-1 every rank has
//      finished reducing round t-1, hence copying out round t-2: a rank's copy-in of round t
//      overwrites only slots nobody reads any more, with no third wait.
// Waiting polls for the spin budget while the host is quiet (PollPhase) and otherwise sleeps on
// the counter's futex; a rank advancing its counter wakes only when someone sleeps on it. A wait
// gives up at the op's deadline, and when the communicator is closed (a peer's pair broke or
// aborted), with the cause.
//
// Each collective's first round also publishes what the rank was asked to do (sequence number,
// element count, dtype, op); a rank that finds another rank's request different fails the op
// naming both, as a ring would on a size mismatch.
//
// The segment is POSIX shared memory of mode 0600 with a random name: rank 0 creates it, sends
// the name over the group's (authenticated) pairs, and unlinks it once every rank has mapped it,
// so only the group's processes hold it and nothing is left behind. Built lazily, by the first
// allreduce that uses it (all of the group's ranks take part in that one).
#pragma once

#include <c10/core/ScalarType.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "comm/core/Collectives.h"
#include "comm/core/Reduce.h"

namespace dicomm {

class SharedSegment {
 public:
  static constexpr size_t kChunkBytes = size_t(1) << 20;

  // Collective over every rank of ctx.comm (all on one host). Null, on every rank alike, when a
  // rank could not create or map the segment (the caller falls back to the ring; the reason is
  // logged).
  static std::unique_ptr<SharedSegment> connect(CollectiveContext& ctx);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  // In-place allreduce of `numel` elements at `buf`, as allreduce() (op refused up front).
  void allreduce(CollectiveContext& ctx, void* buf, size_t numel, c10::ScalarType dtype,
                 ReduceKind op);

 private:
  struct Request;
  struct Line;
  SharedSegment(void* base, size_t bytes, int rank, int size);
  Line& line(int rank) const;
  char* slot(unsigned set, int rank) const;
  void advance(uint32_t stage);
  // Until every rank's stage has reached `stage` (S1/S2); throws naming the rank it waits for.
  void awaitAll(CollectiveContext& ctx, uint32_t stage, const char* what);
  void checkRequests(CollectiveContext& ctx, const Request& mine);

  void* base_;
  size_t bytes_;
  int rank_, size_;
  uint32_t stage_ = 0;  // this rank's counter, as last published
};

}  // namespace dicomm
