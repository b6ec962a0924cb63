#include "comm/core/SharedSegment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

#include "comm/core/Tags.h"
#include "comm/transport/Log.h"
#include "comm/transport/Spin.h"

namespace dicomm {

namespace {

constexpr uint64_t kMagic = 0x64696d6d5345474dULL;  // "dimmSEGM"
constexpr size_t kLine = 128;  // a member's line: its counter and two requests (two cache lines)
constexpr size_t kNameBytes = 64;
// A sleeping waiter looks at the op's deadline and the communicator at least this often.
constexpr auto kWakeEvery = std::chrono::milliseconds(20);

bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

size_t segmentBytes(int size) { return kLine * (1 + size) + 2 * size * SharedSegment::kChunkBytes; }

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string randomName() {
  std::random_device rd;  // /dev/urandom
  char out[40];
  std::snprintf(out, sizeof(out), "/dicomm-%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return out;
}

// memcpy, but an empty tensor's buffer may be null, which memcpy may not be given even for 0 bytes.
void copyBytes(void* dst, const void* src, size_t n) {
  if (n) std::memcpy(dst, src, n);
}

std::string errnoText(const std::string& what) { return what + ": " + std::strerror(errno); }

// Maps `name` (created with `create`, else opened and checked to be ours and of `bytes`).
void* mapSegment(const std::string& name, size_t bytes, bool create, std::string& why) {
  const int fd = create ? ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600)
                        : ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    why = errnoText("shm_open " + name);
    return nullptr;
  }
  void* base = nullptr;
  struct stat st {};
  if (create) {
    // Reserve the pages now: a full /dev/shm is then an error here, not a SIGBUS mid-allreduce.
    const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc != 0) {
      errno = rc;
      why = errnoText("posix_fallocate " + std::to_string(bytes) + " bytes in /dev/shm");
    }
  } else if (::fstat(fd, &st) != 0) {
    why = errnoText("fstat " + name);
  } else if (st.st_uid != ::geteuid() || static_cast<size_t>(st.st_size) != bytes) {
    why = name + " is owned by uid " + std::to_string(st.st_uid) + " and holds " +
          std::to_string(st.st_size) + " bytes; expected ours (" + std::to_string(::geteuid()) +
          ") and " + std::to_string(bytes);
  }
  if (why.empty()) {
    base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      base = nullptr;
      why = errnoText("mmap " + name);
    }
  }
  ::close(fd);
  if (!base && create) ::shm_unlink(name.c_str());  // ours: nobody else will map it now
  return base;
}

}  // namespace

struct SharedSegment::Request {
  uint64_t seq;
  uint64_t numel;
  uint64_t layout;  // a hash of the parts (offsets and counts): the same total cut differently differs
  int32_t dtype;
  int16_t op;
  int16_t steps;
};

struct alignas(64) SharedSegment::Line {
  std::atomic<uint32_t> stage;
  std::atomic<uint32_t> sleepers;  // waiters asleep on `stage`: its owner wakes them
  Request request[2];              // by operation parity, written before its first advance
};
static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free,
              "a futex word must be a lock-free 32-bit atomic");

std::unique_ptr<SharedSegment> SharedSegment::connect(CollectiveContext& ctx, std::vector<int> members) {
  Communicator& comm = *ctx.comm;
  const int n = static_cast<int>(members.size());
  const int position = static_cast<int>(std::find(members.begin(), members.end(), comm.rank()) - members.begin());
  if (position == n) throw std::logic_error("dicomm: SharedSegment::connect on a rank outside its members");
  const int leader = members[0];
  const size_t bytes = segmentBytes(n);
  auto tag = [&](unsigned step) { return collectiveTag(ctx.seq, 0, step, 0); };
  char name[kNameBytes] = {};
  std::string why;
  void* base = nullptr;
  uint8_t ok = 0;
  if (position == 0) {
    const std::string chosen = randomName();
    base = mapSegment(chosen, bytes, /*create=*/true, why);
    if (base) {
      std::memcpy(name, chosen.data(), chosen.size());
      auto* header = static_cast<uint64_t*>(base);
      header[0] = kMagic;
      header[1] = static_cast<uint64_t>(n);
    }
    std::vector<std::shared_ptr<Completion>> sent, acks(n);
    for (int p = 1; p < n; ++p) sent.push_back(comm.isend(members[p], tag(0), name, kNameBytes, -1));
    std::vector<uint8_t> replies(n, 0);
    for (int p = 1; p < n; ++p) acks[p] = comm.irecv(members[p], tag(1), &replies[p], 1, -1);
    for (int p = 1; p < n; ++p) awaitTransfer(ctx, sent[p - 1], members[p], "send the segment's name to");
    ok = base != nullptr;
    for (int p = 1; p < n; ++p) {
      awaitTransfer(ctx, acks[p], members[p], "hear whether it mapped the segment from");
      ok = ok && replies[p];
    }
    if (name[0]) ::shm_unlink(name);  // every member has it mapped, or gave up
    sent.clear();
    for (int p = 1; p < n; ++p) sent.push_back(comm.isend(members[p], tag(2), &ok, 1, -1));
    for (int p = 1; p < n; ++p) awaitTransfer(ctx, sent[p - 1], members[p], "send the verdict to");
  } else {
    awaitTransfer(ctx, comm.irecv(leader, tag(0), name, kNameBytes, -1), leader, "hear the segment's name from");
    name[kNameBytes - 1] = '\0';
    if (name[0]) {
      base = mapSegment(name, bytes, /*create=*/false, why);
      if (base) {
        auto* header = static_cast<uint64_t*>(base);
        if (header[0] != kMagic || header[1] != static_cast<uint64_t>(n)) {
          why = std::string(name) + " is not this group's segment";
          ::munmap(base, bytes);
          base = nullptr;
        }
      }
    } else {
      why = "rank " + std::to_string(leader) + " could not create it";
    }
    uint8_t mine = base != nullptr;
    awaitTransfer(ctx, comm.isend(leader, tag(1), &mine, 1, -1), leader, "tell whether it mapped the segment to");
    awaitTransfer(ctx, comm.irecv(leader, tag(2), &ok, 1, -1), leader, "hear the verdict from");
  }
  if (!ok) {
    if (base) ::munmap(base, bytes);
    logLine(LogLevel::kWarn, "reductions within a host: no shared segment (" +
                                 (why.empty() ? std::string("another rank could not map it") : why) +
                                 "); rings of shm copies instead");
    return nullptr;
  }
  return std::unique_ptr<SharedSegment>(new SharedSegment(base, bytes, std::move(members), position));
}

SharedSegment::SharedSegment(void* base, size_t bytes, std::vector<int> members, int position)
    : base_(base), bytes_(bytes), members_(std::move(members)), position_(position),
      size_(static_cast<int>(members_.size())) {}

SharedSegment::~SharedSegment() { ::munmap(base_, bytes_); }

SharedSegment::Line& SharedSegment::line(int member) const {
  static_assert(sizeof(Line) == kLine, "a member's line is kLine bytes");
  return *reinterpret_cast<Line*>(static_cast<char*>(base_) + kLine * (1 + member));
}

char* SharedSegment::slot(unsigned set, int member) const {
  return static_cast<char*>(base_) + kLine * (1 + size_) + (set * size_ + member) * kChunkBytes;
}

void SharedSegment::advance() {
  Line& mine = line(position_);
  // seq_cst on both sides (here: stage then sleepers; a waiter: sleepers then stage), so either
  // the waiter sees the new stage or this sees the waiter and wakes it.
  mine.stage.store(++stage_, std::memory_order_seq_cst);
  if (mine.sleepers.load(std::memory_order_seq_cst) > 0) futex(&mine.stage, FUTEX_WAKE, INT_MAX, nullptr);
}

void SharedSegment::awaitAll(CollectiveContext& ctx, const char* what) {
  auto failure = [&](int peer, const std::string& cause) {
    return "dicomm " + ctx.op + " (collective #" + std::to_string(ctx.seq) + ") failed waiting for rank " +
           std::to_string(members_[peer]) + " to " + what + " in the host's shared segment: " + cause;
  };
  const uint32_t stage = stage_;
  for (int j = 0; j < size_; ++j) {
    if (j == position_) continue;
    std::atomic<uint32_t>& word = line(j).stage;
    if (reached(word.load(std::memory_order_acquire), stage)) continue;
    {
      PollPhase poll;
      const auto until = std::chrono::steady_clock::now() + poll.budget();
      for (unsigned i = 1; poll.budget().count() > 0; ++i) {
        if (reached(word.load(std::memory_order_acquire), stage)) break;
        if (i == 1) sampleHostLoad(/*callerPolls=*/true);  // idle now: see Spin.h
        if (hostBusy()) break;
        // A few pauses, then yields: the rank this one waits for may be ready to run on this
        // very core (our ranks and their threads outnumber the cores).
        if (i < 64) {
          cpuRelax();
        } else {
          std::this_thread::yield();
          if (std::chrono::steady_clock::now() >= until) break;
        }
      }
    }
    std::atomic<uint32_t>& sleepers = line(j).sleepers;
    while (!reached(word.load(std::memory_order_acquire), stage)) {
      // The deadline first: the group's watchdog closes it at the same moment, with a cause
      // that cannot name the rank this one waits for.
      const auto now = std::chrono::steady_clock::now();
      if (now >= ctx.deadline) {
        const std::string cause = failure(j, "timed out after " + std::to_string(ctx.timeout.count()) + " ms");
        ctx.abort(cause);
        throw std::runtime_error(cause);
      }
      if (ctx.comm->closed()) throw std::runtime_error(failure(j, ctx.comm->closeCause()));
      // A member that shut down its group cleanly breaks no pair, so nothing closes this
      // communicator: its goodbye is the sign it will never reach the stage. What it wrote
      // before leaving counts, hence the second look at its word.
      const std::string left = ctx.comm->peerLeftCause(members_[j]);
      if (!left.empty() && !reached(word.load(std::memory_order_acquire), stage)) {
        throw std::runtime_error(failure(j, left));
      }
      const auto wait = std::min<std::chrono::nanoseconds>(kWakeEvery, ctx.deadline - now);
      timespec ts{static_cast<time_t>(wait.count() / 1'000'000'000), static_cast<long>(wait.count() % 1'000'000'000)};
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t seen = word.load(std::memory_order_seq_cst);
      if (!reached(seen, stage)) futex(&word, FUTEX_WAIT, seen, &ts);
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
}

void SharedSegment::checkRequests(CollectiveContext& ctx, const Request& mine, unsigned place) {
  auto describe = [](const Request& q) {
    static const char* kSteps[] = {"?", "reduce-scatter", "allgather", "allreduce"};
    const bool stepsKnown = q.steps >= 1 && q.steps <= 3;
    char layout[24];
    std::snprintf(layout, sizeof(layout), "%016llx", static_cast<unsigned long long>(q.layout));
    return std::string(stepsKnown ? kSteps[q.steps] : "an unknown step") + " of " + std::to_string(q.numel) +
           " x " + std::string(c10::toString(static_cast<c10::ScalarType>(q.dtype))) + " (" +
           reduceName(static_cast<ReduceKind>(q.op)) + ", collective #" + std::to_string(q.seq) +
           ", parts " + layout + ")";
  };
  for (int j = 0; j < size_; ++j) {
    const Request theirs = line(j).request[place];
    if (j == position_ || std::memcmp(&theirs, &mine, sizeof(Request)) == 0) continue;
    const bool readable = theirs.dtype >= 0 && theirs.dtype < static_cast<int32_t>(c10::ScalarType::NumOptions) &&
                          theirs.op >= 0 && theirs.op <= static_cast<int16_t>(ReduceKind::kBxor);
    const std::string cause = "dicomm " + ctx.op + " (collective #" + std::to_string(ctx.seq) +
                              "): mismatch in the host's shared segment: rank " + std::to_string(members_[j]) +
                              " runs " + (readable ? describe(theirs) : std::string("an unreadable request")) +
                              ", rank " + std::to_string(members_[position_]) + " " + describe(mine) +
                              "; every rank must make the same call";
    ctx.abort(cause);
    throw std::runtime_error(cause);
  }
}

void SharedSegment::run(CollectiveContext& ctx, char* buf, const std::vector<Segment>& parts,
                        c10::ScalarType dtype, ReduceKind op, uint32_t steps, char* own) {
  if (ctx.comm->closed()) throw std::runtime_error("dicomm " + ctx.op + ": " + ctx.comm->closeCause());
  if (static_cast<int>(parts.size()) != size_) {
    throw std::logic_error("dicomm: " + std::to_string(parts.size()) + " parts for a segment of " +
                           std::to_string(size_) + " members");
  }
  const size_t elem = c10::elementSize(dtype);
  const size_t slice = std::max<size_t>(1, kChunkBytes / elem / size_);  // elements of a part per round
  size_t numel = 0, longest = 0;
  uint64_t layout = 1469598103934665603ULL;  // FNV-1a over the parts
  auto mix = [&](uint64_t v) {
    for (int b = 0; b < 8; ++b) layout = (layout ^ ((v >> (8 * b)) & 0xff)) * 1099511628211ULL;
  };
  for (auto& p : parts) {
    numel += p.count;
    longest = std::max(longest, p.count);
    mix(p.offset);
    mix(p.count);
  }
  // At least one round, so that a member with nothing to reduce still checks the others' requests.
  const size_t rounds = std::max<size_t>(1, (longest + slice - 1) / slice);
  const unsigned place = operations_++ & 1;
  const Request mine{ctx.seq, numel, layout, static_cast<int32_t>(dtype), static_cast<int16_t>(op),
                     static_cast<int16_t>(steps)};
  line(position_).request[place] = mine;
  bool checked = false;
  auto checkOnce = [&] {
    if (!checked) checkRequests(ctx, mine, place);
    checked = true;
  };
  for (size_t t = 0; t < rounds; ++t) {
    const unsigned set = rounds_++ & 1;
    char* mySlot = slot(set, position_);
    // Round t's slice of part j: its place in `buf`, its length, and its place in a slot.
    auto at = [&](int j) { return buf + (parts[j].offset + std::min(parts[j].count, t * slice)) * elem; };
    auto count = [&](int j) { return std::min(slice, parts[j].count - std::min(parts[j].count, t * slice)); };
    auto inSlot = [&](int j) { return j * slice * elem; };
    if (steps & kReduce) {
      for (int j = 0; j < size_; ++j) {
        if (j != position_) copyBytes(mySlot + inSlot(j), at(j), count(j) * elem);
      }
      advance();
      awaitAll(ctx, "copy its input in");  // S1
      checkOnce();
      char* into = at(position_);
      if (own) {
        into = own + std::min(parts[position_].count, t * slice) * elem;
        if (into != at(position_)) copyBytes(into, at(position_), count(position_) * elem);
      }
      for (int j = 0; j < size_; ++j) {
        if (j != position_) reduceInto(into, slot(set, j) + inSlot(position_), count(position_), dtype, op);
      }
      if (op == ReduceKind::kAvg) finishAvg(into, count(position_), dtype, size_);
    }
    if (steps & kGather) {
      copyBytes(mySlot + inSlot(position_), at(position_), count(position_) * elem);
      advance();
      awaitAll(ctx, "publish its part");  // S2
      checkOnce();
      for (int j = 0; j < size_; ++j) {
        if (j != position_) copyBytes(at(j), slot(set, j) + inSlot(j), count(j) * elem);
      }
    }
  }
}

void SharedSegment::allreduce(CollectiveContext& ctx, void* buf, size_t numel, c10::ScalarType dtype,
                              ReduceKind op) {
  run(ctx, static_cast<char*>(buf), splitEven(numel, size_), dtype, op, kReduce | kGather);
}

void SharedSegment::reduceScatter(CollectiveContext& ctx, const void* in, const std::vector<Segment>& parts,
                                  void* out, c10::ScalarType dtype, ReduceKind op) {
  // The reduce step alone writes nothing of `buf` but its own part, and that goes to `out`.
  run(ctx, const_cast<char*>(static_cast<const char*>(in)), parts, dtype, op, kReduce, static_cast<char*>(out));
}

void SharedSegment::allgather(CollectiveContext& ctx, void* buf, const std::vector<Segment>& parts,
                              c10::ScalarType dtype) {
  run(ctx, static_cast<char*>(buf), parts, dtype, ReduceKind::kSum, kGather);
}

}  // namespace dicomm
