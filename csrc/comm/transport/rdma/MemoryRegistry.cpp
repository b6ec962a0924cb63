#include "comm/transport/rdma/MemoryRegistry.h"

#include <errno.h>

#include <c10/core/CPUAllocator.h>

#include <set>
#include <system_error>

namespace dicomm {
namespace rdma {

Registration::~Registration() {
  if (mr) ibv_dereg_mr(mr);
}

namespace {

struct Allocation {
  size_t size = 0;
  c10::DeleterFnPtr deleter = nullptr;
  uint64_t generation = 0;  // tells a block from a later one at the same address
};

// Process-wide: frees arrive from any thread, until exit; never destroyed.
struct Tracker {
  std::mutex mu;
  std::map<uintptr_t, Allocation> live;
  std::set<MrCache*> caches;
  c10::Allocator* wrapped = nullptr;
  bool installed = false;
  uint64_t nextGeneration = 1;
};
Tracker& tracker() {
  static Tracker* t = new Tracker;
  return *t;
}

void trackedFree(void* p) {
  Tracker& t = tracker();
  c10::DeleterFnPtr deleter = nullptr;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    auto it = t.live.find(reinterpret_cast<uintptr_t>(p));
    if (it != t.live.end()) {
      deleter = it->second.deleter;
      for (MrCache* cache : t.caches) cache->invalidate(it->first, it->second.size);
      t.live.erase(it);
    }
  }
  if (!deleter) deleter = t.wrapped->raw_deleter();  // a raw allocation we did not track
  if (deleter) deleter(p);
}

// Wraps torch's CPU allocator; large blocks get `trackedFree` as their deleter.
class TrackingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    Tracker& t = tracker();
    c10::DataPtr dp = t.wrapped->allocate(n);
    if (n < kTrackedMin || dp.get() == nullptr || dp.get() != dp.get_context()) return dp;
    c10::DeleterFnPtr deleter = dp.get_deleter();
    c10::Device device = dp.device();
    void* p = dp.release_context();
    {
      std::lock_guard<std::mutex> lock(t.mu);
      t.live[reinterpret_cast<uintptr_t>(p)] = Allocation{n, deleter, t.nextGeneration++};
    }
    return c10::DataPtr(p, p, &trackedFree, device);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return tracker().wrapped->raw_deleter() ? &trackedFree : nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    tracker().wrapped->copy_data(dest, src, count);
  }
};

// Finds the tracked allocation holding [p, p + n); returns false if none does.
bool findAllocation(Tracker& t, uintptr_t p, size_t n, uintptr_t* base, Allocation* a) {
  auto it = t.live.upper_bound(p);
  if (it == t.live.begin()) return false;
  --it;
  if (it->first + it->second.size < p + n) return false;
  *base = it->first;
  *a = it->second;
  return true;
}

}  // namespace

void trackCpuAllocations() {
  Tracker& t = tracker();
  std::lock_guard<std::mutex> lock(t.mu);
  if (t.installed) return;
  static TrackingAllocator allocator;
  t.wrapped = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&allocator, /*priority=*/0);
  // A higher-priority allocator someone else installed wins; then nothing is tracked and
  // every registration is per transfer, which is slower but still correct.
  t.installed = c10::GetCPUAllocator() == &allocator;
}

MrCache::MrCache(ibv_pd* pd) : pd_(pd) {
  std::lock_guard<std::mutex> lock(tracker().mu);
  tracker().caches.insert(this);
}

MrCache::~MrCache() {
  {
    std::lock_guard<std::mutex> lock(tracker().mu);
    tracker().caches.erase(this);
  }
  std::lock_guard<std::mutex> lock(mu_);
  byBase_.clear();
}

RegistrationRef MrCache::registerRange(const void* data, size_t n, int access) {
  auto reg = std::make_shared<Registration>();
  reg->mr = ibv_reg_mr(pd_, const_cast<void*>(data), n, access);
  if (!reg->mr) {
    int err = errno ? errno : ENOMEM;
    throw std::system_error(err, std::generic_category(), "ibv_reg_mr");
  }
  return reg;
}

RegistrationRef MrCache::get(const void* data, size_t n, int access) {
  Tracker& t = tracker();
  const uintptr_t p = reinterpret_cast<uintptr_t>(data);
  uintptr_t base = 0;
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    if (findAllocation(t, p, n, &base, &a)) {
      std::lock_guard<std::mutex> cacheLock(mu_);
      auto it = byBase_.find(base);
      if (it != byBase_.end() && (it->second.second & access) == access) {
        ++hits_;
        return it->second.first;
      }
    } else {
      base = 0;
    }
  }
  if (base == 0) {
    ++uncached_;
    return registerRange(data, n, access);
  }
  // Register the whole block outside the locks (it can take a while), then keep it only if
  // the block was not freed meanwhile.
  ++misses_;
  RegistrationRef reg = registerRange(reinterpret_cast<void*>(base), a.size, access);
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.live.find(base);
  if (it != t.live.end() && it->second.generation == a.generation) {
    std::lock_guard<std::mutex> cacheLock(mu_);
    byBase_[base] = {reg, access};
  }
  return reg;
}

void MrCache::invalidate(uintptr_t base, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  // Cached entries are keyed by the base of a whole tracked block, so a freed block matches
  // at most its own key; the range scan guards against blocks the allocator carved up.
  for (auto it = byBase_.lower_bound(base); it != byBase_.end() && it->first < base + n;) {
    it = byBase_.erase(it);
  }
}

}  // namespace rdma
}  // namespace dicomm
