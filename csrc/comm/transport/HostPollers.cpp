#include "comm/transport/HostPollers.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace dicomm {

namespace {

constexpr size_t kTableBytes = sizeof(std::atomic<int32_t>) * 2 * HostPollers::kSlots;

// This process's id, kept current across fork() without a system call per use.
std::atomic<int32_t> currentPid{0};

int32_t thisPid() {
  static const bool registered = [] {
    currentPid.store(static_cast<int32_t>(::getpid()));
    pthread_atfork(nullptr, nullptr, [] { currentPid.store(static_cast<int32_t>(::getpid())); });
    return true;
  }();
  (void)registered;
  return currentPid.load(std::memory_order_relaxed);
}

bool alive(int32_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

}  // namespace

HostPollers::HostPollers(const std::string& path) {
  thisPid();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return;
  struct stat st {};
  // Only a plain file of ours, empty (new) or the table's size: never another program's file.
  const bool ours = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() &&
                    (st.st_size == 0 || st.st_size == static_cast<off_t>(kTableBytes));
  if (ours && (st.st_size == static_cast<off_t>(kTableBytes) || ::ftruncate(fd, kTableBytes) == 0)) {
    void* p = ::mmap(nullptr, kTableBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) slots_ = static_cast<Slot*>(p);  // zero-filled when new: every slot free
  }
  ::close(fd);
}

HostPollers::~HostPollers() {
  if (!slots_) return;
  if (mine_ && pid_ == thisPid()) {
    mine_->pollers.store(0);
    mine_->pid.store(0);
  }
  ::munmap(slots_, kTableBytes);
}

HostPollers::Slot* HostPollers::claim() {
  const int32_t me = thisPid();
  for (int i = 0; i < kSlots; ++i) {
    Slot& s = slots_[i];
    int32_t holder = s.pid.load();
    if (holder == me) return &s;  // ours already (a table opened twice in one process)
    if (holder != 0 && alive(holder)) continue;
    if (s.pid.compare_exchange_strong(holder, me)) {
      s.pollers.store(0);
      return &s;
    }
  }
  return nullptr;
}

void HostPollers::add(int delta) {
  if (!slots_) return;
  if (pid_ != thisPid()) {  // first use, or a forked child holding its parent's slot
    pid_ = thisPid();
    mine_ = claim();
  }
  if (mine_) mine_->pollers.fetch_add(delta, std::memory_order_relaxed);
}

int HostPollers::others() const {
  if (!slots_) return 0;
  const int32_t me = thisPid();
  int total = 0;
  for (int i = 0; i < kSlots; ++i) {
    const int32_t pid = slots_[i].pid.load(std::memory_order_relaxed);
    if (pid == 0 || pid == me) continue;
    const int n = std::clamp<int>(slots_[i].pollers.load(std::memory_order_relaxed), 0, kMaxPerProcess);
    if (n > 0 && alive(pid)) total += n;  // a process that died polling leaves its count behind
  }
  return total;
}

HostPollers& hostPollers() {
  static HostPollers* table = new HostPollers("/dev/shm/dicomm-pollers-" + std::to_string(::geteuid()));
  return *table;  // leaked: pollers may still publish during static destruction
}

}  // namespace dicomm
