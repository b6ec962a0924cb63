#include "comm/transport/SmallFrameRing.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <new>

namespace dicomm {

namespace {
constexpr uint32_t kMagic = 0x64724e47;  // "dRNG"
constexpr uint32_t kAway = 0, kAwake = 1;
constexpr size_t kSlotsAt = 4096;  // the control words on a page of their own
}  // namespace

// Each side's word on a cache line of its own: the writer's count, the reader's count, the
// reader's state.
struct SmallFrameRing::Control {
  alignas(64) std::atomic<uint64_t> head;  // slots published (writer)
  alignas(64) std::atomic<uint64_t> tail;  // slots consumed (reader)
  alignas(64) std::atomic<uint32_t> state;  // kAway / kAwake (reader)
  uint32_t magic;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory atomics must be lock-free");

size_t SmallFrameRing::bytes() {
  static_assert(sizeof(Control) <= kSlotsAt, "the control words fit their page");
  return kSlotsAt + kSlots * kSlotBytes;
}

SmallFrameRing::SmallFrameRing(char* base, int fd) : base_(base), fd_(fd) {}

SmallFrameRing::~SmallFrameRing() {
  ::munmap(base_, bytes());
  if (fd_ >= 0) ::close(fd_);
}

SmallFrameRing::Control& SmallFrameRing::control() const {
  return *reinterpret_cast<Control*>(base_);
}

char* SmallFrameRing::slot(uint64_t index) const {
  return base_ + kSlotsAt + (index % kSlots) * kSlotBytes;
}

std::unique_ptr<SmallFrameRing> SmallFrameRing::create(std::string* why) {
  const int fd = ::memfd_create("dicomm-ring", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes())) != 0) {
    *why = std::string("memfd_create/ftruncate: ") + std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *why = std::string("mmap: ") + std::strerror(errno);
    ::close(fd);
    return nullptr;
  }
  auto* c = new (p) Control();
  c->head.store(0);
  c->tail.store(0);
  c->state.store(kAway);
  c->magic = kMagic;
  return std::unique_ptr<SmallFrameRing>(new SmallFrameRing(static_cast<char*>(p), fd));
}

std::unique_ptr<SmallFrameRing> SmallFrameRing::openPeer(pid_t pid, int fd, std::string* why) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int mine = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (mine < 0) {
    *why = "open " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  struct stat st;
  if (::fstat(mine, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != static_cast<off_t>(bytes())) {
    *why = path + " is not a ring of " + std::to_string(bytes()) + " bytes";
    ::close(mine);
    return nullptr;
  }
  void* p = ::mmap(nullptr, bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, mine, 0);
  ::close(mine);  // the mapping keeps the memory
  if (p == MAP_FAILED) {
    *why = std::string("mmap ") + path + ": " + std::strerror(errno);
    return nullptr;
  }
  std::unique_ptr<SmallFrameRing> ring(new SmallFrameRing(static_cast<char*>(p), -1));
  if (ring->control().magic != kMagic) {
    *why = path + " is not a dicomm ring (magic)";
    return nullptr;
  }
  return ring;
}

SmallFrameRing::Put SmallFrameRing::publish(const void* header, const void* payload, size_t n) {
  Control& c = control();
  if (n > kPayloadMax) return Put::kFull;
  if (c.state.load(std::memory_order_seq_cst) != kAwake) return Put::kReaderAway;
  const uint64_t head = c.head.load(std::memory_order_relaxed);
  if (head - c.tail.load(std::memory_order_acquire) >= kSlots) return Put::kFull;
  char* s = slot(head);
  std::memcpy(s, header, kHeaderBytes);
  if (n) std::memcpy(s + kHeaderBytes, payload, n);
  c.head.store(head + 1, std::memory_order_seq_cst);
  // The reader may have gone away between the first look and the publication: it either saw
  // this slot on its last look, or sleeps and needs the bell (see the top of the header).
  return c.state.load(std::memory_order_seq_cst) == kAwake ? Put::kPublished : Put::kPublishedWake;
}

void SmallFrameRing::setAwake() { control().state.store(kAwake, std::memory_order_seq_cst); }

void SmallFrameRing::setAway() { control().state.store(kAway, std::memory_order_seq_cst); }

const char* SmallFrameRing::peek(bool* corrupt) const {
  Control& c = control();
  const uint64_t tail = c.tail.load(std::memory_order_relaxed);
  const uint64_t head = c.head.load(std::memory_order_seq_cst);
  *corrupt = head - tail > kSlots;
  if (head == tail || *corrupt) return nullptr;
  return slot(tail);
}

bool SmallFrameRing::pending() const {
  const Control& c = control();
  return c.head.load(std::memory_order_acquire) != c.tail.load(std::memory_order_relaxed);
}

void SmallFrameRing::consume() {
  Control& c = control();
  c.tail.store(c.tail.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}

}  // namespace dicomm
