// Collectives composed from point-to-point transfers on host buffers.
//
// Ring reduce-scatter / allgather (and allreduce = both) move each segment in chunks so that
// the transfer of chunk j+1 overlaps the reduction of chunk j and a rank forwards chunk j as
// soon as it has it. Broadcast and reduce use a binomial tree, also chunked. Every wait honours
// the op's deadline. A collective refuses what it cannot do before it posts anything; any
// failure after it posted a transfer closes the communicator *before* the error unwinds
// (await() for a failed transfer, a guard in every entry point for anything else), so no
// transport thread can still be writing into a buffer that is being freed.
#pragma once

#include <c10/core/ScalarType.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "comm/core/Communicator.h"
#include "comm/core/Reduce.h"

namespace dicomm {

class SharedSegment;

struct CollectiveContext {
  Communicator* comm = nullptr;
  uint64_t seq = 0;  // the group's collective sequence number: tags messages
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
  std::string op;  // e.g. "allreduce", for error messages
  size_t chunkBytes = 4 << 20;
  // Closes the communicator with `cause` (must be synchronous, see above).
  std::function<void(const std::string& cause)> abort;
  // The shared-memory segment of this rank's host within the group (SharedSegment.h),
  // connected by the first call; null when there is none. Set only where hostSegmentUsable().
  std::function<SharedSegment*(CollectiveContext&)> hostSegment;
};

// Wait for one transfer of a collective; on timeout or error close the communicator first
// (ctx.abort), then throw naming the op, `what` ("receive from", ...) and `peer`.
void awaitTransfer(CollectiveContext& ctx, const std::shared_ptr<Completion>& c, int peer,
                   const char* what);

struct Segment {
  size_t offset = 0;  // elements
  size_t count = 0;   // elements
};

// The ranks a ring visits, in order, and this rank's position among them.
struct Ring {
  std::vector<int> ranks;
  int position = 0;
  int size() const { return static_cast<int>(ranks.size()); }
  static Ring all(const Communicator& comm);  // 0 .. n-1
};

// How an allreduce is built (DICOMM_ALLREDUCE): one flat ring over all ranks; two levels
// (a reduce-scatter within each host, then one ring per local index across hosts, then an
// allgather within each host: fewer steps, and fewer bytes across hosts); or, for a group on
// one host, one shared-memory segment every rank reduces into (SharedSegment.h). The host
// level of the two levels goes through the host's segment too where hostSegmentUsable(), and
// is a ring over shm otherwise. A group on one host resolves kAuto to kShared. A group over
// two or more hosts holding the same number (two or more) of its ranks each resolves it to
// kHierarchical where hostSegmentUsable(): fewer bytes cross hosts and none goes round a ring
// inside one, which was faster at every size measured (docs/dicomm.md, Measured); otherwise
// kAuto stays, and takes the two levels for payloads below kHierarchyMaxBytes (fewer steps)
// and the flat ring above (rings inside the hosts cost as much as the steps they save).
enum class AllreduceAlgorithm { kAuto, kRing, kHierarchical, kShared };
constexpr int kSharedMaxRanks = 64;  // a segment holds two chunks per rank
constexpr size_t kHierarchyMaxBytes = size_t(4) << 20;
// At most this many bytes, a ring's allreduce (the flat one, and each rail of the two levels)
// is recursive doubling instead: latency-bound, it takes log2(n) exchanges of the whole buffer
// rather than the ring's 2 (n - 1) steps (as MPICH does for short messages).
constexpr size_t kDoublingMaxBytes = size_t(16) << 10;
// What `wanted` resolves to for this group: kAuto stays kAuto only where the hierarchy is
// possible; a forced hierarchy or shared segment the group cannot have becomes the ring, with
// a warning.
AllreduceAlgorithm chooseAllreduce(const Communicator& comm, AllreduceAlgorithm wanted);
// Whether each host's ranks of the group can reduce through one shared segment: 2 to
// kSharedMaxRanks ranks on every host, and no transport but shared memory forced (a forced tcp
// or rdma is what the user wants measured).
bool hostSegmentUsable(const Communicator& comm);
// "2 host(s) of 2 + 2 rank(s)".
std::string describeHosts(const Communicator& comm);

// `n` segments of as equal size as possible covering `numel` elements.
std::vector<Segment> splitEven(size_t numel, int n);

// After return, segment `rank` of `buf` holds the reduction over ranks (others: partial sums).
void ringReduceScatter(CollectiveContext& ctx, void* buf, const std::vector<Segment>& segs,
                       c10::ScalarType dtype, ReduceKind op, unsigned phase = 0);
// The same over `ring` only: segment i belongs to the ring's i-th rank.
void ringReduceScatter(CollectiveContext& ctx, const Ring& ring, void* buf,
                       const std::vector<Segment>& segs, c10::ScalarType dtype, ReduceKind op,
                       unsigned phase);
// Before: segment `rank` of `buf` is this rank's; after: every segment is everyone's.
void ringAllgather(CollectiveContext& ctx, void* buf, const std::vector<Segment>& segs,
                   c10::ScalarType dtype, unsigned phase = 1);
void ringAllgather(CollectiveContext& ctx, const Ring& ring, void* buf,
                   const std::vector<Segment>& segs, c10::ScalarType dtype, unsigned phase);
// An allreduce of `numel` elements of `buf` over `ring` by recursive doubling, with `op`
// (kAvg is the caller's: pass kSum and divide). Every rank ends with the same bits: the two
// partners of a round reduce the same two values, with commutative ops.
void doublingAllreduce(CollectiveContext& ctx, const Ring& ring, void* buf, size_t numel,
                       c10::ScalarType dtype, ReduceKind op, unsigned phase);
// The reduce-scatter and allgather of the process group's ops: through the host's shared
// segment for a group on one host that has one (ctx.hostSegment), else one ring. After
// reduceScatter, `out` holds the reduction of segment `rank` of `in` (an AVG divided by the
// group's size); `in` is only read, and `out` may be that segment of it. allgather as
// ringAllgather.
void reduceScatter(CollectiveContext& ctx, const void* in, const std::vector<Segment>& segs,
                   void* out, c10::ScalarType dtype, ReduceKind op);
void allgather(CollectiveContext& ctx, void* buf, const std::vector<Segment>& segs,
               c10::ScalarType dtype);
// `algorithm` as resolved by chooseAllreduce.
void allreduce(CollectiveContext& ctx, void* buf, size_t numel, c10::ScalarType dtype,
               ReduceKind op, AllreduceAlgorithm algorithm = AllreduceAlgorithm::kRing);
void broadcast(CollectiveContext& ctx, void* buf, size_t numel, c10::ScalarType dtype, int root);
// Root: `buf` becomes the reduction. Others: `buf` is only read.
void reduce(CollectiveContext& ctx, void* buf, size_t numel, c10::ScalarType dtype, ReduceKind op,
            int root);
// Root receives every rank's `nbytes` at out + rank * nbytes (its own included).
void gather(CollectiveContext& ctx, const void* in, size_t numel, c10::ScalarType dtype, void* out,
            int root);
// Root sends in + rank * nbytes to each rank; every rank's `out` gets its piece.
void scatter(CollectiveContext& ctx, const void* in, void* out, size_t numel,
             c10::ScalarType dtype, int root);
// Rank r sends sendCounts[p] elements from in + sendOffsets[p] to p and receives
// recvCounts[p] elements into out + recvOffsets[p] from p.
void alltoall(CollectiveContext& ctx, const void* in, const std::vector<size_t>& sendOffsets,
              const std::vector<size_t>& sendCounts, void* out,
              const std::vector<size_t>& recvOffsets, const std::vector<size_t>& recvCounts,
              c10::ScalarType dtype);
void barrier(CollectiveContext& ctx);

}  // namespace dicomm
