#include "device/KernelCosts.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace ditorch {
namespace {

constexpr char kMagic[8] = {'D', 'T', 'K', 'C', 'O', 'S', 'T', '2'};

std::string errnoText(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

bool readAll(int fd, void* data, size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t got = ::read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= size_t(got);
  }
  return true;
}

bool writeAll(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = ::write(fd, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put;
    n -= size_t(put);
  }
  return true;
}

struct Entry {
  uint64_t signature;
  int64_t ns;
  uint64_t samples;
};

// The process's table: loaded lazily, saved at exit. Never destroyed (it is used until exit).
class SharedTable {
 public:
  static SharedTable& get() {
    static SharedTable* table = new SharedTable();
    return *table;
  }

  int64_t least(uint64_t signature, int64_t host_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = costs_.find(signature);
    if (it == costs_.end()) {
      if (costs_.size() >= kMaxKernelCosts) return host_ns;
      it = costs_.emplace(signature, KernelCost{}).first;
    }
    if (!it->second.fixed()) {
      it->second.add(host_ns);
      added_[signature].add(host_ns);
    }
    return it->second.ns;
  }

  bool enabled() const { return !path_.empty(); }

 private:
  SharedTable() {
    const char* path = std::getenv(kKernelCostsEnv);
    if (path == nullptr || *path == '\0') return;
    path_ = path;
    const std::string error = readKernelCosts(path_, costs_);
    if (!error.empty())
      std::fprintf(stderr, "ditorch: %s=%s: %s; starting from an empty table (it is rewritten at exit)\n",
                   kKernelCostsEnv, path, error.c_str());
    std::atexit([] { get().save(); });
  }

  void save() {
    KernelCostMap copy;
    {
      std::lock_guard<std::mutex> lock(mu_);
      copy = added_;
    }
    const std::string error = mergeKernelCosts(path_, copy);
    if (!error.empty())
      std::fprintf(stderr, "ditorch: %s: the kernel cost table was not saved: %s\n", kKernelCostsEnv, error.c_str());
  }

  std::mutex mu_;
  KernelCostMap costs_;  // what is charged: the file's costs and this process's samples
  KernelCostMap added_;  // this process's samples alone, merged into the file at exit
  std::string path_;
};

}  // namespace

void KernelCost::add(int64_t host_ns) {
  if (fixed()) return;
  ns = samples == 0 ? host_ns : std::min(ns, host_ns);
  ++samples;
}

void KernelCost::merge(const KernelCost& other) {
  if (fixed() || other.samples == 0) return;
  if (other.fixed()) {
    *this = other;
    return;
  }
  ns = samples == 0 ? other.ns : std::min(ns, other.ns);
  samples = std::min(kKernelCostSamples, samples + other.samples);
}

std::string readKernelCosts(const std::string& path, KernelCostMap& costs) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? "" : errnoText("cannot open", path);
  struct stat st {};
  char magic[8];
  uint64_t count = 0;
  std::string error;
  std::vector<Entry> entries;
  if (::fstat(fd, &st) != 0) {
    error = errnoText("cannot stat", path);
  } else if (!readAll(fd, magic, sizeof magic) || std::memcmp(magic, kMagic, sizeof magic) != 0) {
    error = "not a kernel cost table (expected the header DTKCOST1)";
  } else if (!readAll(fd, &count, sizeof count) || count > kMaxKernelCosts) {
    error = "entry count " + std::to_string(count) + " is beyond " + std::to_string(kMaxKernelCosts);
  } else if (uint64_t(st.st_size) != sizeof magic + sizeof count + count * sizeof(Entry)) {
    error = "size " + std::to_string(st.st_size) + " bytes does not match its " + std::to_string(count) +
            " entries (a torn write?)";
  } else {
    entries.resize(count);
    if (count > 0 && !readAll(fd, entries.data(), count * sizeof(Entry))) error = errnoText("cannot read", path);
    for (const Entry& e : entries) {
      if (!error.empty()) break;
      if (e.ns <= 0) error = "an entry of " + std::to_string(e.ns) + " ns (expected > 0)";
      else if (e.samples == 0 || e.samples > kKernelCostSamples)
        error = "an entry of " + std::to_string(e.samples) + " samples (expected 1 to " +
                std::to_string(kKernelCostSamples) + ")";
    }
  }
  ::close(fd);
  if (!error.empty()) return error;
  for (const Entry& e : entries) costs[e.signature].merge(KernelCost{e.ns, e.samples});
  return "";
}

std::string mergeKernelCosts(const std::string& path, const KernelCostMap& costs) {
  const std::string lock_path = path + ".lock";
  const int lock = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock < 0) return errnoText("cannot open", lock_path);
  while (::flock(lock, LOCK_EX) != 0 && errno == EINTR) {
  }
  KernelCostMap merged;
  // the file first (its fixed costs win), then this process's samples; a malformed file on
  // disk is replaced by what this process knows
  (void)readKernelCosts(path, merged);
  for (const auto& [signature, cost] : costs) merged[signature].merge(cost);
  std::vector<Entry> entries;
  entries.reserve(std::min<size_t>(merged.size(), kMaxKernelCosts));
  for (const auto& [signature, cost] : merged) {
    if (entries.size() == kMaxKernelCosts) break;
    if (cost.samples > 0) entries.push_back({signature, cost.ns, cost.samples});
  }
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::string error;
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const uint64_t count = entries.size();
  if (fd < 0) {
    error = errnoText("cannot create", tmp);
  } else {
    if (!writeAll(fd, kMagic, sizeof kMagic) || !writeAll(fd, &count, sizeof count) ||
        !writeAll(fd, entries.data(), count * sizeof(Entry)) || ::fsync(fd) != 0)
      error = errnoText("cannot write", tmp);
    if (::close(fd) != 0 && error.empty()) error = errnoText("cannot close", tmp);
    if (error.empty() && ::rename(tmp.c_str(), path.c_str()) != 0) error = errnoText("cannot rename over", path);
    if (!error.empty()) ::unlink(tmp.c_str());
  }
  ::flock(lock, LOCK_UN);
  ::close(lock);
  return error;
}

int64_t leastKnownHostTime(uint64_t signature, int64_t host_ns) {
  SharedTable& table = SharedTable::get();
  return table.enabled() ? table.least(signature, host_ns) : -1;
}

}  // namespace ditorch
