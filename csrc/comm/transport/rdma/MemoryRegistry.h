// Memory registration for the rdma transport: a cache of ibv_mr per protection domain.
//
// Registering per message is what makes gloo's ibverbs path slow (a pin and an IOMMU/page
// table walk every time), so registrations are kept. A kept registration is only correct
// while the memory behind its virtual range stays the same: glibc returns large blocks to the
// kernel on free and the next allocation of that size usually gets the same address with
// other pages, and a stale MR then moves the wrong bytes. So a registration is cached only
// when the range lies inside an allocation whose free this module hears about: large blocks
// from torch's CPU allocator, which `trackCpuAllocations()` wraps. The whole allocation is
// registered once; every tensor view inside it hits. Any other range (memory allocated before
// tracking started, other allocators) is registered for the one transfer and released after.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace dicomm {
namespace rdma {

// A registration in use; the MR is deregistered when the last holder lets go.
struct Registration {
  ibv_mr* mr = nullptr;
  ~Registration();
  uint32_t lkey() const { return mr->lkey; }
  uint32_t rkey() const { return mr->rkey; }
};
using RegistrationRef = std::shared_ptr<Registration>;

class MrCache {
 public:
  explicit MrCache(ibv_pd* pd);
  ~MrCache();
  MrCache(const MrCache&) = delete;
  MrCache& operator=(const MrCache&) = delete;

  // A registration covering [data, data + n) with `access` (IBV_ACCESS_* flags). Throws
  // std::system_error carrying ibv_reg_mr's errno.
  RegistrationRef get(const void* data, size_t n, int access);

  // Drops cached registrations overlapping [base, base + n) (the memory is being freed).
  void invalidate(uintptr_t base, size_t n);

  uint64_t hits() const { return hits_.load(); }
  uint64_t misses() const { return misses_.load(); }
  uint64_t uncached() const { return uncached_.load(); }

 private:
  RegistrationRef registerRange(const void* data, size_t n, int access);
  ibv_pd* pd_;
  std::mutex mu_;
  std::map<uintptr_t, std::pair<RegistrationRef, int>> byBase_;  // allocation base -> (MR, access)
  std::atomic<uint64_t> hits_{0}, misses_{0}, uncached_{0};
};

// Installs (once per process) the torch CPU allocator wrapper that reports large frees to
// every live MrCache. Allocations smaller than `kTrackedMin` are not tracked (they travel
// through bounce buffers anyway).
void trackCpuAllocations();
constexpr size_t kTrackedMin = 64 << 10;

}  // namespace rdma
}  // namespace dicomm
