#include "comm/core/Collectives.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include "comm/core/SharedSegment.h"
#include "comm/core/Tags.h"
#include "comm/transport/Log.h"

namespace dicomm {

namespace {

using CompletionPtr = std::shared_ptr<Completion>;

int mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

void awaitTransfer(CollectiveContext& ctx, const CompletionPtr& c, int peer, const char* what) {
  // Reading the peer's connection on this thread spares the receive thread's wake-up and then
  // this one's: a barrier's or a small allreduce's every step (kBlockOnPeer bounds a busy host's
  // sleep there, as for a point-to-point op).
  Communicator::awaitReading(ctx.comm, peer, c->doneFlag(),
                             std::min(ctx.deadline, std::chrono::steady_clock::now() + Communicator::kBlockOnPeer));
  if (!c->waitUntil(ctx.deadline)) {
    std::string cause = "dicomm " + ctx.op + " (collective #" + std::to_string(ctx.seq) +
                        ") timed out after " + std::to_string(ctx.timeout.count()) +
                        " ms waiting to " + what + " rank " + std::to_string(peer);
    ctx.abort(cause);
    throw std::runtime_error(cause);
  }
  if (auto e = c->error()) {
    std::string cause;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      cause = ex.what();
    }
    std::string msg = "dicomm " + ctx.op + " (collective #" + std::to_string(ctx.seq) +
                      ") failed to " + what + " rank " + std::to_string(peer) + ": " + cause;
    ctx.abort(msg);
    throw std::runtime_error(msg);
  }
}

namespace {

// Declared first in every collective: if an exception leaves the collective after this thread
// posted transfers for it, the communicator is closed while the caller's buffers still exist
// (they are freed as the exception unwinds further). awaitTransfer() closes it itself, with the
// transfer's own cause; this catches everything else (an allocation that fails, say).
class CloseOnUnwind {
 public:
  explicit CloseOnUnwind(CollectiveContext& ctx)
      : ctx_(ctx), uncaught_(std::uncaught_exceptions()), posted_(Communicator::postedByThisThread()) {}
  ~CloseOnUnwind() {
    if (std::uncaught_exceptions() <= uncaught_ || Communicator::postedByThisThread() == posted_) return;
    try {
      ctx_.abort("dicomm " + ctx_.op + " (collective #" + std::to_string(ctx_.seq) +
                 ") failed after posting transfers; the group is aborted so that none lands in "
                 "freed memory (the op's own error says why)");
    } catch (...) {
    }
  }
  CloseOnUnwind(const CloseOnUnwind&) = delete;
  CloseOnUnwind& operator=(const CloseOnUnwind&) = delete;

 private:
  CollectiveContext& ctx_;
  const int uncaught_;
  const uint64_t posted_;
};

struct Pending {
  CompletionPtr c;
  int peer;
  const char* what;
};

void awaitAll(CollectiveContext& ctx, std::vector<Pending>& ps) {
  for (auto& p : ps) awaitTransfer(ctx, p.c, p.peer, p.what);
  ps.clear();
}

constexpr size_t kMaxChunks = 65536;  // the tag's 16-bit chunk field (Tags.h)

size_t chunkStride(size_t elem, size_t chunkBytes) {
  return std::max<size_t>(elem, chunkBytes / elem * elem);
}

// Throws before anything is posted when a segment would need more chunks than a tag can number.
void checkChunkCount(const std::vector<Segment>& segs, size_t elem, size_t chunkBytes) {
  const size_t per = chunkStride(elem, chunkBytes);
  for (auto& s : segs) {
    const size_t chunks = (s.count * elem + per - 1) / per;
    if (chunks > kMaxChunks) {
      throw std::invalid_argument(
          "dicomm: a " + std::to_string(s.count * elem) + "-byte segment in chunks of " +
          std::to_string(per) + " bytes makes " + std::to_string(chunks) + " chunks, more than the " +
          std::to_string(kMaxChunks) + " a collective can number; raise DICOMM_CHUNK_BYTES (now " +
          std::to_string(chunkBytes) + ")");
    }
  }
}

// Calls f(j, offset, bytes) for chunk j of segment `s`, in order; sender and receiver cut a
// segment alike. The count was checked (checkChunkCount) before anything was posted.
template <typename F>
void forEachChunk(const Segment& s, size_t elem, size_t chunkBytes, F&& f) {
  const size_t bytes = s.count * elem, per = chunkStride(elem, chunkBytes);
  unsigned j = 0;
  for (size_t off = 0; off < bytes; off += per) f(j++, off, std::min(per, bytes - off));
}

int32_t dt(c10::ScalarType t) { return static_cast<int32_t>(t); }

}  // namespace

std::vector<Segment> splitEven(size_t numel, int n) {
  std::vector<Segment> segs(n);
  size_t base = numel / n, extra = numel % n, off = 0;
  for (int i = 0; i < n; ++i) {
    segs[i].offset = off;
    segs[i].count = base + (static_cast<size_t>(i) < extra ? 1 : 0);
    off += segs[i].count;
  }
  return segs;
}

Ring Ring::all(const Communicator& comm) {
  Ring ring;
  for (int p = 0; p < comm.size(); ++p) ring.ranks.push_back(p);
  ring.position = comm.rank();
  return ring;
}

void ringReduceScatter(CollectiveContext& ctx, void* buf, const std::vector<Segment>& segs,
                       c10::ScalarType dtype, ReduceKind op, unsigned phase) {
  ringReduceScatter(ctx, Ring::all(*ctx.comm), buf, segs, dtype, op, phase);
}

void ringReduceScatter(CollectiveContext& ctx, const Ring& ring, void* buf,
                       const std::vector<Segment>& segs, c10::ScalarType dtype, ReduceKind op,
                       unsigned phase) {
  CloseOnUnwind guard(ctx);
  Communicator& comm = *ctx.comm;
  const int n = ring.size(), r = ring.position;
  if (n == 1) return;
  const size_t elem = c10::elementSize(dtype);
  checkChunkCount(segs, elem, ctx.chunkBytes);
  const int right = ring.ranks[mod(r + 1, n)], left = ring.ranks[mod(r - 1, n)];
  char* base = static_cast<char*>(buf);
  size_t maxSeg = 0;
  for (auto& s : segs) maxSeg = std::max(maxSeg, s.count * elem);
  // Reused across collectives of this (collective) thread: a fresh buffer this large is a fresh
  // mmap, and first-touch page faults then cost as much as the transfer itself.
  thread_local std::vector<char> scratch;
  const size_t slot = (maxSeg + 63) & ~size_t(63);
  if (scratch.size() < 2 * slot + 1) scratch.resize(2 * slot + 1);
  char* temp[2] = {scratch.data(), scratch.data() + slot};
  std::vector<Pending> sends;
  std::vector<std::vector<CompletionPtr>> recvs(n);

  // Step k: send segment r-k-1 to the right, receive segment r-k-2 from the left and reduce it.
  auto postRecvs = [&](int k) {
    forEachChunk(segs[mod(r - k - 2, n)], elem, ctx.chunkBytes, [&](unsigned j, size_t off, size_t len) {
      recvs[k].push_back(comm.irecv(left, collectiveTag(ctx.seq, phase, k, j),
                                    temp[k % 2] + off, len, dt(dtype)));
    });
  };
  auto postSend = [&](int k, unsigned j, size_t off, size_t len) {
    const Segment& s = segs[mod(r - k - 1, n)];
    sends.push_back({comm.isend(right, collectiveTag(ctx.seq, phase, k, j),
                                base + s.offset * elem + off, len, dt(dtype)),
                     right, "send to"});
  };
  // Receives first: a message whose receive is already posted lands in place.
  postRecvs(0);
  forEachChunk(segs[mod(r - 1, n)], elem, ctx.chunkBytes,
               [&](unsigned j, size_t off, size_t len) { postSend(0, j, off, len); });
  for (int k = 0; k < n - 1; ++k) {
    if (k + 1 < n - 1) postRecvs(k + 1);
    const Segment& s = segs[mod(r - k - 2, n)];
    forEachChunk(s, elem, ctx.chunkBytes, [&](unsigned j, size_t off, size_t len) {
      awaitTransfer(ctx, recvs[k][j], left, "receive from");
      reduceInto(base + s.offset * elem + off, temp[k % 2] + off, len / elem, dtype, op);
      if (k + 1 < n - 1) postSend(k + 1, j, off, len);  // forward as soon as it is reduced
    });
  }
  awaitAll(ctx, sends);
}

void ringAllgather(CollectiveContext& ctx, void* buf, const std::vector<Segment>& segs,
                   c10::ScalarType dtype, unsigned phase) {
  ringAllgather(ctx, Ring::all(*ctx.comm), buf, segs, dtype, phase);
}

void ringAllgather(CollectiveContext& ctx, const Ring& ring, void* buf,
                   const std::vector<Segment>& segs, c10::ScalarType dtype, unsigned phase) {
  CloseOnUnwind guard(ctx);
  Communicator& comm = *ctx.comm;
  const int n = ring.size(), r = ring.position;
  if (n == 1) return;
  const size_t elem = c10::elementSize(dtype);
  checkChunkCount(segs, elem, ctx.chunkBytes);
  const int right = ring.ranks[mod(r + 1, n)], left = ring.ranks[mod(r - 1, n)];
  char* base = static_cast<char*>(buf);
  std::vector<Pending> sends;
  // Step k: send segment r-k to the right, receive segment r-k-1 from the left (into place).
  std::vector<std::vector<CompletionPtr>> recvs(n);
  auto postSend = [&](int k, const Segment& s, unsigned j, size_t off, size_t len) {
    sends.push_back({comm.isend(right, collectiveTag(ctx.seq, phase, k, j),
                                base + s.offset * elem + off, len, dt(dtype)),
                     right, "send to"});
  };
  for (int k = 0; k < n - 1; ++k) {
    const Segment& s = segs[mod(r - k - 1, n)];
    forEachChunk(s, elem, ctx.chunkBytes, [&](unsigned j, size_t off, size_t len) {
      recvs[k].push_back(comm.irecv(left, collectiveTag(ctx.seq, phase, k, j),
                                    base + s.offset * elem + off, len, dt(dtype)));
    });
  }
  forEachChunk(segs[r], elem, ctx.chunkBytes,
               [&](unsigned j, size_t off, size_t len) { postSend(0, segs[r], j, off, len); });
  for (int k = 0; k < n - 1; ++k) {
    const Segment& s = segs[mod(r - k - 1, n)];
    forEachChunk(s, elem, ctx.chunkBytes, [&](unsigned j, size_t off, size_t len) {
      awaitTransfer(ctx, recvs[k][j], left, "receive from");
      if (k + 1 < n - 1) postSend(k + 1, s, j, off, len);  // forward as soon as it arrived
    });
  }
  awaitAll(ctx, sends);
}

void doublingAllreduce(CollectiveContext& ctx, const Ring& ring, void* buf, size_t numel,
                       c10::ScalarType dtype, ReduceKind op, unsigned phase) {
  CloseOnUnwind guard(ctx);
  Communicator& comm = *ctx.comm;
  const int n = ring.size(), r = ring.position;
  if (n == 1 || numel == 0) return;
  const size_t elem = c10::elementSize(dtype);
  const Segment whole{0, numel};
  checkChunkCount({whole}, elem, ctx.chunkBytes);
  char* base = static_cast<char*>(buf);
  thread_local std::vector<char> scratch;
  if (scratch.size() < numel * elem) scratch.resize(numel * elem);
  int core = 1;  // the largest power of two <= n
  while (core * 2 <= n) core *= 2;
  const int extra = n - core;
  int rounds = 0;
  while ((1 << rounds) < core) ++rounds;
  // Step 0 pairs the first 2 * extra ranks, steps 1..rounds are the exchanges, the last step
  // hands the result back to the ranks that sat out.
  const unsigned last = static_cast<unsigned>(rounds) + 1;
  auto send = [&](int peer, unsigned step, std::vector<Pending>& into) {
    forEachChunk(whole, elem, ctx.chunkBytes, [&](unsigned j, size_t off, size_t len) {
      into.push_back({comm.isend(peer, collectiveTag(ctx.seq, phase, step, j), base + off, len, dt(dtype)),
                      peer, "send to"});
    });
  };
  auto receive = [&](int peer, unsigned step, char* to, std::vector<Pending>& into) {
    forEachChunk(whole, elem, ctx.chunkBytes, [&](unsigned j, size_t off, size_t len) {
      into.push_back({comm.irecv(peer, collectiveTag(ctx.seq, phase, step, j), to + off, len, dt(dtype)),
                      peer, "receive from"});
    });
  };
  std::vector<Pending> pending;
  if (r < 2 * extra && r % 2 == 0) {  // sits out: its value goes in through its odd neighbour
    const int partner = ring.ranks[r + 1];
    send(partner, 0, pending);
    awaitAll(ctx, pending);
    receive(partner, last, base, pending);
    awaitAll(ctx, pending);
    return;
  }
  if (r < 2 * extra) {
    receive(ring.ranks[r - 1], 0, scratch.data(), pending);
    awaitAll(ctx, pending);
    reduceInto(base, scratch.data(), numel, dtype, op);
  }
  const int vr = r < 2 * extra ? r / 2 : r - extra;
  auto ringIndex = [&](int v) { return v < extra ? 2 * v + 1 : v + extra; };
  for (int i = 0; i < rounds; ++i) {
    const int peer = ring.ranks[ringIndex(vr ^ (1 << i))];
    receive(peer, static_cast<unsigned>(i) + 1, scratch.data(), pending);
    send(peer, static_cast<unsigned>(i) + 1, pending);
    awaitAll(ctx, pending);  // the send reads `buf`: it completes before the reduction writes it
    reduceInto(base, scratch.data(), numel, dtype, op);
  }
  if (r < 2 * extra) {
    send(ring.ranks[r - 1], last, pending);
    awaitAll(ctx, pending);
  }
}

AllreduceAlgorithm chooseAllreduce(const Communicator& comm, AllreduceAlgorithm wanted) {
  const auto& hosts = comm.hosts();
  bool uniform = hosts.size() >= 2;
  for (auto& h : hosts) uniform = uniform && h.size() == hosts[0].size();
  const bool hierarchy = uniform && hosts[0].size() >= 2;
  const bool shared = hosts.size() == 1 && hostSegmentUsable(comm);
  if (wanted == AllreduceAlgorithm::kAuto) {
    if (shared) return AllreduceAlgorithm::kShared;
    // With each host's level in its segment, two levels are faster at every size (they move
    // fewer bytes across hosts and none through a ring inside one); without, only below
    // kHierarchyMaxBytes.
    if (hierarchy && hostSegmentUsable(comm)) return AllreduceAlgorithm::kHierarchical;
    return hierarchy ? AllreduceAlgorithm::kAuto : AllreduceAlgorithm::kRing;
  }
  if (wanted == AllreduceAlgorithm::kShared && !shared) {
    logLine(LogLevel::kWarn,
            "DICOMM_ALLREDUCE=shared needs a group of 2 to " + std::to_string(kSharedMaxRanks) +
                " ranks on one host and DICOMM_TRANSPORT auto or shm; a group of " + describeHosts(comm) +
                " uses one flat ring");
    return AllreduceAlgorithm::kRing;
  }
  if (wanted == AllreduceAlgorithm::kHierarchical && !hierarchy) {
    // The variable applies to every group, subgroups within one host included: fall back.
    logLine(LogLevel::kWarn,
            "DICOMM_ALLREDUCE=hierarchical needs at least two hosts with the same number (at least "
            "two) of ranks each; a group of " + describeHosts(comm) + " uses one flat ring");
    return AllreduceAlgorithm::kRing;
  }
  return wanted;
}

bool hostSegmentUsable(const Communicator& comm) {
  // With rdma usable, auto reaches same-host peers over rdma, yet the segment is still the
  // faster way for host buffers.
  if (comm.transportAsked() != "auto" && comm.transportAsked() != "shm") return false;
  for (auto& h : comm.hosts()) {
    if (h.size() < 2 || h.size() > static_cast<size_t>(kSharedMaxRanks)) return false;
  }
  return true;
}

std::string describeHosts(const Communicator& comm) {
  std::string out;
  for (auto& h : comm.hosts()) out += (out.empty() ? "" : " + ") + std::to_string(h.size());
  return std::to_string(comm.hosts().size()) + " host(s) of " + out + " rank(s)";
}

namespace {

// A ring reduce-scatter over the whole group, an AVG finished on this rank's segment.
void ringReduceScatterFinished(CollectiveContext& ctx, void* buf, const std::vector<Segment>& segs,
                               c10::ScalarType dtype, ReduceKind op) {
  const int n = ctx.comm->size(), r = ctx.comm->rank();
  ringReduceScatter(ctx, buf, segs, dtype, op, 0);
  if (op == ReduceKind::kAvg) {
    finishAvg(static_cast<char*>(buf) + segs[r].offset * c10::elementSize(dtype), segs[r].count,
              dtype, n);
  }
}

void flatAllreduce(CollectiveContext& ctx, void* buf, size_t numel, c10::ScalarType dtype,
                   ReduceKind op) {
  if (numel * c10::elementSize(dtype) <= kDoublingMaxBytes) {
    doublingAllreduce(ctx, Ring::all(*ctx.comm), buf, numel, dtype,
                      op == ReduceKind::kAvg ? ReduceKind::kSum : op, 0);
    if (op == ReduceKind::kAvg) finishAvg(buf, numel, dtype, ctx.comm->size());
    return;
  }
  auto segs = splitEven(numel, ctx.comm->size());
  ringReduceScatterFinished(ctx, buf, segs, dtype, op);
  ringAllgather(ctx, buf, segs, dtype, 1);
}

// The segment of a group whose ranks are all on this host, if it has one.
SharedSegment* wholeGroupSegment(CollectiveContext& ctx) {
  if (!ctx.hostSegment || ctx.comm->hosts().size() != 1) return nullptr;
  return ctx.hostSegment(ctx);
}

// Two levels: a reduce-scatter inside each host (through the host's shared segment, else a ring
// over shm), then one ring per local index across the hosts ("rails": local rank i of every
// host), each carrying 1/L of the data, then an allgather inside the host. Inter-host bytes:
// 2 (H-1) S in all, against 2 (n-1)/n S per ring hop of which H cross hosts in a flat ring; and
// (L-1) + (H-1) steps per phase instead of n-1.
void hierarchicalAllreduce(CollectiveContext& ctx, void* buf, size_t numel,
                           c10::ScalarType dtype, ReduceKind op) {
  const Communicator& comm = *ctx.comm;
  const auto& hosts = comm.hosts();
  const int me = comm.rank();
  const int host = comm.hostOf(me);
  Ring local;
  local.ranks = hosts[host];
  local.position = static_cast<int>(std::find(local.ranks.begin(), local.ranks.end(), me) -
                                    local.ranks.begin());
  Ring rail;
  for (auto& h : hosts) rail.ranks.push_back(h[local.position]);
  rail.position = host;
  // AVG sums all the way and divides once, by the whole group's size.
  const ReduceKind sumOp = op == ReduceKind::kAvg ? ReduceKind::kSum : op;
  const size_t elem = c10::elementSize(dtype);

  auto localSegs = splitEven(numel, local.size());
  SharedSegment* segment = ctx.hostSegment ? ctx.hostSegment(ctx) : nullptr;
  if (segment) {
    char* mine = static_cast<char*>(buf) + localSegs[local.position].offset * elem;
    segment->reduceScatter(ctx, buf, localSegs, mine, dtype, sumOp);
  } else {
    ringReduceScatter(ctx, local, buf, localSegs, dtype, sumOp, 0);
  }
  const Segment mine = localSegs[local.position];
  char* mineAt = static_cast<char*>(buf) + mine.offset * elem;
  if (mine.count * elem <= kDoublingMaxBytes) {
    doublingAllreduce(ctx, rail, mineAt, mine.count, dtype, sumOp, 2);
    if (op == ReduceKind::kAvg) finishAvg(mineAt, mine.count, dtype, comm.size());
  } else {
    auto railSegs = splitEven(mine.count, rail.size());
    for (auto& s : railSegs) s.offset += mine.offset;
    ringReduceScatter(ctx, rail, buf, railSegs, dtype, sumOp, 2);
    if (op == ReduceKind::kAvg) {
      const Segment& done = railSegs[rail.position];
      finishAvg(static_cast<char*>(buf) + done.offset * elem, done.count, dtype, comm.size());
    }
    ringAllgather(ctx, rail, buf, railSegs, dtype, 3);
  }
  if (segment) {
    segment->allgather(ctx, buf, localSegs, dtype);
  } else {
    ringAllgather(ctx, local, buf, localSegs, dtype, 1);
  }
}

}  // namespace

void reduceScatter(CollectiveContext& ctx, const void* in, const std::vector<Segment>& segs,
                   void* out, c10::ScalarType dtype, ReduceKind op) {
  CloseOnUnwind guard(ctx);
  const int r = ctx.comm->rank();
  const size_t elem = c10::elementSize(dtype);
  auto copyMine = [&](const char* from) {
    if (segs[r].count && out != from + segs[r].offset * elem) std::memmove(out, from + segs[r].offset * elem, segs[r].count * elem);
  };
  if (ctx.comm->size() == 1) {
    copyMine(static_cast<const char*>(in));
    return;
  }
  size_t end = 0;
  for (auto& s : segs) end = std::max(end, s.offset + s.count);
  // A private copy of the input, in a buffer kept across collectives of this (collective)
  // thread, as the ring's own scratch is: a fresh one is a fresh mmap whose first-touch page
  // faults cost more than the reduce-scatter itself.
  thread_local std::vector<char> work;
  auto privateCopy = [&] {
    if (work.size() < end * elem) work.resize(end * elem);
    if (end) std::memcpy(work.data(), in, end * elem);
    return work.data();
  };
  if (SharedSegment* segment = wholeGroupSegment(ctx)) {
    // The segment writes the output round by round while it still reads the input's later
    // rounds: an output overlapping the input anywhere but at its own part (torch allows it)
    // would read back half-reduced values, so that rank reads a copy. The choice is local: every
    // rank still takes the segment.
    const char* inBytes = static_cast<const char*>(in);
    const char* outBytes = static_cast<const char*>(out);
    const bool ownPart = outBytes == inBytes + segs[r].offset * elem;
    const bool overlaps = outBytes < inBytes + end * elem && inBytes < outBytes + segs[r].count * elem;
    segment->reduceScatter(ctx, overlaps && !ownPart ? privateCopy() : in, segs, out, dtype, op);
    return;
  }
  // The ring leaves partial sums in every segment: it works on the copy.
  char* copy = privateCopy();
  ringReduceScatterFinished(ctx, copy, segs, dtype, op);
  copyMine(copy);
}

void allgather(CollectiveContext& ctx, void* buf, const std::vector<Segment>& segs,
               c10::ScalarType dtype) {
  CloseOnUnwind guard(ctx);
  if (ctx.comm->size() == 1) return;
  if (SharedSegment* segment = wholeGroupSegment(ctx)) {
    segment->allgather(ctx, buf, segs, dtype);
  } else {
    ringAllgather(ctx, buf, segs, dtype);
  }
}

void allreduce(CollectiveContext& ctx, void* buf, size_t numel, c10::ScalarType dtype,
               ReduceKind op, AllreduceAlgorithm algorithm) {
  CloseOnUnwind guard(ctx);
  if (ctx.comm->size() == 1) return;
  if (algorithm == AllreduceAlgorithm::kShared) {
    if (SharedSegment* segment = ctx.hostSegment ? ctx.hostSegment(ctx) : nullptr) {
      segment->allreduce(ctx, buf, numel, dtype, op);
      return;
    }
    algorithm = AllreduceAlgorithm::kRing;  // the group could not map one (logged)
  }
  const bool small = numel * c10::elementSize(dtype) < kHierarchyMaxBytes;
  if (algorithm == AllreduceAlgorithm::kHierarchical ||
      (algorithm == AllreduceAlgorithm::kAuto && small)) {
    hierarchicalAllreduce(ctx, buf, numel, dtype, op);
  } else {
    flatAllreduce(ctx, buf, numel, dtype, op);
  }
}

namespace {
// Binomial tree over ranks relative to the root: parent and children of `vr`.
int treeParent(int vr) {
  if (vr == 0) return -1;
  int mask = 1;
  while (!(vr & mask)) mask <<= 1;
  return vr - mask;
}
std::vector<int> treeChildren(int vr, int n) {
  std::vector<int> kids;
  int limit = 1;
  if (vr == 0) {
    while (limit < n) limit <<= 1;
  } else {
    while (!(vr & limit)) limit <<= 1;
  }
  for (int m = limit >> 1; m >= 1; m >>= 1) {
    if (vr + m < n) kids.push_back(vr + m);
  }
  return kids;
}
}  // namespace

void broadcast(CollectiveContext& ctx, void* buf, size_t numel, c10::ScalarType dtype, int root) {
  CloseOnUnwind guard(ctx);
  Communicator& comm = *ctx.comm;
  const int n = comm.size(), r = comm.rank();
  if (n == 1) return;
  const size_t elem = c10::elementSize(dtype);
  const int vr = mod(r - root, n);
  const int vparent = treeParent(vr);
  const int parent = vparent < 0 ? -1 : mod(vparent + root, n);
  std::vector<int> kids;
  for (int v : treeChildren(vr, n)) kids.push_back(mod(v + root, n));
  char* base = static_cast<char*>(buf);
  const Segment all{0, numel};
  checkChunkCount({all}, elem, ctx.chunkBytes);
  std::vector<CompletionPtr> recvs;
  if (parent >= 0) {
    forEachChunk(all, elem, ctx.chunkBytes, [&](unsigned j, size_t off, size_t len) {
      recvs.push_back(comm.irecv(parent, collectiveTag(ctx.seq, 0, 0, j), base + off, len, dt(dtype)));
    });
  }
  std::vector<Pending> sends;
  forEachChunk(all, elem, ctx.chunkBytes, [&](unsigned j, size_t off, size_t len) {
    if (parent >= 0) awaitTransfer(ctx, recvs[j], parent, "receive from");
    for (int kid : kids) {
      sends.push_back({comm.isend(kid, collectiveTag(ctx.seq, 0, 0, j), base + off, len, dt(dtype)),
                       kid, "send to"});
    }
  });
  awaitAll(ctx, sends);
}

void reduce(CollectiveContext& ctx, void* buf, size_t numel, c10::ScalarType dtype, ReduceKind op,
            int root) {
  CloseOnUnwind guard(ctx);
  Communicator& comm = *ctx.comm;
  const int n = comm.size(), r = comm.rank();
  const size_t elem = c10::elementSize(dtype), bytes = numel * elem;
  if (n == 1) return;
  const int vr = mod(r - root, n);
  const int vparent = treeParent(vr);
  const int parent = vparent < 0 ? -1 : mod(vparent + root, n);
  std::vector<int> kids;
  for (int v : treeChildren(vr, n)) kids.push_back(mod(v + root, n));
  // Accumulate in place on the root; elsewhere in a copy so the caller's input stays intact.
  std::unique_ptr<char[]> copy;
  char* acc = static_cast<char*>(buf);
  if (parent >= 0 && !kids.empty()) {
    copy.reset(new char[bytes + 1]);
    if (bytes) std::memcpy(copy.get(), buf, bytes);  // an empty tensor's buffer may be null
    acc = copy.get();
  }
  const Segment all{0, numel};
  checkChunkCount({all}, elem, ctx.chunkBytes);
  std::vector<std::unique_ptr<char[]>> temps;
  std::vector<std::vector<CompletionPtr>> recvs(kids.size());
  for (size_t i = 0; i < kids.size(); ++i) {
    temps.emplace_back(new char[bytes + 1]);
    forEachChunk(all, elem, ctx.chunkBytes, [&](unsigned j, size_t off, size_t len) {
      recvs[i].push_back(comm.irecv(kids[i], collectiveTag(ctx.seq, 0, 0, j), temps[i].get() + off,
                                    len, dt(dtype)));
    });
  }
  std::vector<Pending> sends;
  forEachChunk(all, elem, ctx.chunkBytes, [&](unsigned j, size_t off, size_t len) {
    for (size_t i = 0; i < kids.size(); ++i) {
      awaitTransfer(ctx, recvs[i][j], kids[i], "receive from");
      reduceInto(acc + off, temps[i].get() + off, len / elem, dtype, op);
    }
    if (parent >= 0) {
      sends.push_back({comm.isend(parent, collectiveTag(ctx.seq, 0, 0, j), acc + off, len, dt(dtype)),
                       parent, "send to"});
    }
  });
  awaitAll(ctx, sends);
  if (parent < 0 && op == ReduceKind::kAvg) finishAvg(buf, numel, dtype, n);
}

namespace {

// Gather and scatter are one pattern, mirrored: the root moves slice p of `rootBuffer` to or
// from rank p (its own slice by memcpy), every other rank its one buffer `mine` to or from the
// root. `toRoot` says which way the data flows (gather: true); only the receiving side's buffer
// is written, so the callers may pass their read-only buffer here.
void rootedExchange(CollectiveContext& ctx, bool toRoot, char* rootBuffer, void* mine,
                    size_t numel, c10::ScalarType dtype, int root) {
  Communicator& comm = *ctx.comm;
  const int n = comm.size(), r = comm.rank();
  const size_t bytes = numel * c10::elementSize(dtype);
  const auto tag = collectiveTag(ctx.seq, 0, 0, 0);
  const bool receives = (r == root) == toRoot;  // root of a gather, non-root of a scatter
  auto move = [&](int peer, void* buf) -> Pending {
    if (receives) return {comm.irecv(peer, tag, buf, bytes, dt(dtype)), peer, "receive from"};
    return {comm.isend(peer, tag, buf, bytes, dt(dtype)), peer, "send to"};
  };
  std::vector<Pending> ps;
  if (r != root) {
    ps.push_back(move(root, mine));
  } else {
    for (int p = 0; p < n; ++p) {
      char* slice = rootBuffer + p * bytes;
      if (p != r) {
        ps.push_back(move(p, slice));
      } else if (bytes && slice != mine) {
        std::memcpy(toRoot ? slice : mine, toRoot ? mine : slice, bytes);
      }
    }
  }
  awaitAll(ctx, ps);
}

}  // namespace

void gather(CollectiveContext& ctx, const void* in, size_t numel, c10::ScalarType dtype, void* out,
            int root) {
  CloseOnUnwind guard(ctx);
  rootedExchange(ctx, /*toRoot=*/true, static_cast<char*>(out), const_cast<void*>(in), numel,
                 dtype, root);
}

void scatter(CollectiveContext& ctx, const void* in, void* out, size_t numel,
             c10::ScalarType dtype, int root) {
  CloseOnUnwind guard(ctx);
  rootedExchange(ctx, /*toRoot=*/false, static_cast<char*>(const_cast<void*>(in)), out, numel,
                 dtype, root);
}

void alltoall(CollectiveContext& ctx, const void* in, const std::vector<size_t>& sendOffsets,
              const std::vector<size_t>& sendCounts, void* out,
              const std::vector<size_t>& recvOffsets, const std::vector<size_t>& recvCounts,
              c10::ScalarType dtype) {
  CloseOnUnwind guard(ctx);
  Communicator& comm = *ctx.comm;
  const int n = comm.size(), r = comm.rank();
  const size_t elem = c10::elementSize(dtype);
  const char* i = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  if (sendCounts[r] != recvCounts[r]) {
    throw std::invalid_argument("dicomm alltoall: rank " + std::to_string(r) + " sends itself " +
                                std::to_string(sendCounts[r]) + " elements but expects " +
                                std::to_string(recvCounts[r]));
  }
  std::vector<Pending> ps;
  for (int k = 1; k < n; ++k) {
    // Stagger peers so every rank starts with a different partner.
    int to = mod(r + k, n), from = mod(r - k, n);
    ps.push_back({comm.irecv(from, collectiveTag(ctx.seq, 0, 0, 0), o + recvOffsets[from] * elem,
                             recvCounts[from] * elem, dt(dtype)),
                  from, "receive from"});
    ps.push_back({comm.isend(to, collectiveTag(ctx.seq, 0, 0, 0), i + sendOffsets[to] * elem,
                             sendCounts[to] * elem, dt(dtype)),
                  to, "send to"});
  }
  if (sendCounts[r]) std::memmove(o + recvOffsets[r] * elem, i + sendOffsets[r] * elem, sendCounts[r] * elem);
  awaitAll(ctx, ps);
}

void barrier(CollectiveContext& ctx) {
  CloseOnUnwind guard(ctx);
  // Dissemination barrier: ceil(log2 n) rounds of empty messages.
  Communicator& comm = *ctx.comm;
  const int n = comm.size(), r = comm.rank();
  unsigned round = 0;
  for (int d = 1; d < n; d <<= 1, ++round) {
    std::vector<Pending> ps;
    int to = mod(r + d, n), from = mod(r - d, n);
    ps.push_back({comm.irecv(from, collectiveTag(ctx.seq, 0, round, 0), nullptr, 0, -1), from,
                  "receive from"});
    ps.push_back({comm.isend(to, collectiveTag(ctx.seq, 0, round, 0), nullptr, 0, -1), to,
                  "send to"});
    awaitAll(ctx, ps);
  }
}

}  // namespace dicomm
