// Reductions among the ranks of one host through one shared-memory segment they all map,
// instead of a ring of copies from rank to rank: the allreduce, reduce-scatter and allgather of
// a group on one host, and the host level (reduce-scatter, then allgather) of the two-level
// allreduce across hosts.
//
// The members split the payload into parts (allreduce: n even parts; a reduce-scatter or
// allgather: the group's or the two-level allreduce's segments), and every part goes through the segment in rounds of one slice per part
// (n slices fill one slot of kChunkBytes, small enough to stay in the cores' caches). A round
// has up to two steps:
//   reduce  every member copies into its own slot the slices the others reduce; once all have,
//           member i reduces its slice in place in its own buffer (its input, then every other
//           slot's slice i, in a fixed order, so every rank gets the same bits);
//   gather  member i copies its (reduced) slice into its slot; once all have, every member
//           copies the others' slices out into its buffer.
// allreduce runs both steps in each round, reduceScatter only the first, allgather only the
// second. Memory traffic of an allreduce per member is one read of its input and one write of
// its output, as a memcpy; the slots in between stay in cache, where a ring moves each byte
// through memory once per hop and hands every chunk between threads.
//
// Synchronisation is one 32-bit counter per member ("stage"), advanced once per step, after
// the step's copy-in. Every member runs the same sequence of steps, so a step's wait is for
// every stage to reach this member's own. Invariants:
//   S1 a member reduces a round's slices only once every stage has passed that round's reduce
//      copy-in (every slot holds the round's input);
//   S2 a member copies out only once every stage has passed that round's gather copy-in (every
//      slice is reduced and published);
//   S3 rounds alternate between two sets of slots, counted across operations. A member starts
//      writing round t's set after the first wait of round t-1, which every member passes
//      only once all have advanced in round t-1, hence finished reading round t-2 (the same
//      set): no third wait is needed. Within a round a member writes its slot's slice i only
//      in the gather step, while the others read only their own slices of it.
// Waiting polls for the spin budget while the host is quiet (PollPhase) and otherwise sleeps on
// the counter's futex; a member advancing its counter wakes only when someone sleeps on it. A
// wait gives up at the op's deadline, and when the communicator is closed (a peer's pair broke
// or aborted), with the cause.
//
// Each operation's first round also publishes what the member was asked to do (sequence
// number, element count, a hash of how the parts cut it, dtype, op, steps); a member that
// finds another's request different fails the op naming both, as a ring would on a size
// mismatch. Requests alternate between two places by operation: a member writes operation
// k+2's request only after all have advanced in operation k+1, hence finished checking
// operation k's.
//
// The segment is POSIX shared memory of mode 0600 with a random name: the first member creates
// it, sends the name over the group's (authenticated) pairs, and unlinks it once every member
// has mapped it, so only the members' processes hold it and nothing is left behind. Built
// lazily, by the first allreduce that uses it (all members take part in that one).
#pragma once

#include <c10/core/ScalarType.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/core/Collectives.h"
#include "comm/core/Reduce.h"

namespace dicomm {

class SharedSegment {
 public:
  static constexpr size_t kChunkBytes = size_t(1) << 20;

  // Collective over `members` (ranks of ctx.comm, ascending, all on this host, this rank among
  // them). Null, on every member alike, when one could not create or map the segment (the
  // caller falls back to rings; the reason is logged).
  static std::unique_ptr<SharedSegment> connect(CollectiveContext& ctx, std::vector<int> members);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  // The ranks that map the segment, and this rank's index among them.
  const std::vector<int>& members() const { return members_; }
  int position() const { return position_; }

  // In-place allreduce over the members of `numel` elements at `buf`, as allreduce() (op
  // refused up front).
  void allreduce(CollectiveContext& ctx, void* buf, size_t numel, c10::ScalarType dtype,
                 ReduceKind op);
  // `parts` of `in` has one entry per member; `in` is only read. After return, `out` holds the
  // reduction of parts[position()] over the members (an AVG divided by their number); it may
  // be that part of `in` itself.
  void reduceScatter(CollectiveContext& ctx, const void* in, const std::vector<Segment>& parts,
                     void* out, c10::ScalarType dtype, ReduceKind op);
  // Before: parts[position()] of `buf` is this member's; after: every part is every member's.
  void allgather(CollectiveContext& ctx, void* buf, const std::vector<Segment>& parts,
                 c10::ScalarType dtype);

 private:
  enum Steps : uint32_t { kReduce = 1, kGather = 2 };
  struct Request;
  struct Line;
  SharedSegment(void* base, size_t bytes, std::vector<int> members, int position);
  Line& line(int member) const;
  char* slot(unsigned set, int member) const;
  void advance();
  // Until every member's stage has reached this member's (S1/S2); throws naming the rank it
  // waits for.
  void awaitAll(CollectiveContext& ctx, const char* what);
  void checkRequests(CollectiveContext& ctx, const Request& mine, unsigned place);
  // The rounds of one operation: `steps` of each, over `parts` of `buf`; the reduce step puts
  // this member's part into `own` (null: in place).
  void run(CollectiveContext& ctx, char* buf, const std::vector<Segment>& parts,
           c10::ScalarType dtype, ReduceKind op, uint32_t steps, char* own = nullptr);

  void* base_;
  size_t bytes_;
  std::vector<int> members_;  // ranks of the communicator
  int position_, size_;
  uint32_t stage_ = 0;       // this member's counter, as last published
  uint64_t rounds_ = 0;      // rounds run so far, over all operations (S3's alternation)
  uint64_t operations_ = 0;  // operations run so far (where requests go)
};

}  // namespace dicomm
