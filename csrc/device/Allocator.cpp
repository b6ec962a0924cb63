#include "device/Allocator.h"

#include "device/ChipProfile.h"
#include "device/Guard.h"
#include "device/MemoryWindow.h"
#include "device/Stream.h"
#include "device/ThreadSpares.h"
#include "device/vendor/Vendor.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>

#include <unistd.h>

namespace ditorch {
namespace {

constexpr size_t kSmallRound = 512;
constexpr size_t kLargeRound = 128 << 10;
constexpr size_t kSmallLimit = 1 << 20;

size_t roundSize(size_t bytes) {
  size_t unit = bytes <= kSmallLimit ? kSmallRound : kLargeRound;
  return (bytes + unit - 1) / unit * unit;
}

std::string formatBytes(int64_t bytes) {
  char buf[64];
  if (bytes >= (int64_t(1) << 30)) snprintf(buf, sizeof buf, "%.2f GiB", bytes / double(1 << 30));
  else if (bytes >= (1 << 20)) snprintf(buf, sizeof buf, "%.2f MiB", bytes / double(1 << 20));
  else snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(bytes));
  return buf;
}

// The stats pools, as CUDA splits them: blocks up to 1 MiB are small, larger ones large.
int poolOf(size_t size) {
  using c10::CachingAllocator::StatType;
  return static_cast<int>(size <= kSmallLimit ? StatType::SMALL_POOL : StatType::LARGE_POOL);
}
// (Inlined: an adopted kernel result updates fourteen of these.)
[[gnu::always_inline]] inline void increase(c10::CachingAllocator::StatArray& stat, int pool, size_t amount) {
  stat[0].increase(amount);  // StatType::AGGREGATE
  stat[pool].increase(amount);
}
[[gnu::always_inline]] inline void decrease(c10::CachingAllocator::StatArray& stat, int pool, size_t amount) {
  stat[0].decrease(amount);
  stat[pool].decrease(amount);
}
// A live block: `size` bytes (rounded), `requested` asked for.
void countAllocation(DeviceStats& st, size_t size, size_t requested) {
  const int pool = poolOf(size);
  increase(st.allocation, pool, 1);
  increase(st.active, pool, 1);
  increase(st.allocated_bytes, pool, size);
  increase(st.active_bytes, pool, size);
  increase(st.requested_bytes, pool, requested);
}
void countFree(DeviceStats& st, size_t size, size_t requested) {
  const int pool = poolOf(size);
  decrease(st.allocation, pool, 1);
  decrease(st.active, pool, 1);
  decrease(st.allocated_bytes, pool, size);
  decrease(st.active_bytes, pool, size);
  decrease(st.requested_bytes, pool, requested);
}
// Device memory held from the vendor (live or cached): one segment per block, as nothing splits.
void countSegment(DeviceStats& st, size_t size) {
  const int pool = poolOf(size);
  increase(st.segment, pool, 1);
  increase(st.reserved_bytes, pool, size);
}
// Every Stat of `st`, the per-pool arrays and the oversize counters: what a reset goes over.
template <typename Fn>
void forEachStat(DeviceStats& st, Fn fn) {
  for (auto* array : {&st.allocation, &st.segment, &st.active, &st.inactive_split, &st.allocated_bytes,
                      &st.reserved_bytes, &st.active_bytes, &st.inactive_split_bytes, &st.requested_bytes})
    for (auto& stat : *array) fn(stat);
  fn(st.oversize_allocations);
  fn(st.oversize_segments);
}

void countSegmentFree(DeviceStats& st, size_t size) {
  const int pool = poolOf(size);
  decrease(st.segment, pool, 1);
  decrease(st.reserved_bytes, pool, size);
}

struct Block {
  size_t size;
  size_t requested;
  int device;
};

// A kernel result in the vendor's own memory, adopted as a dipu block as it is (no copy): counted
// in its device's statistics while the dipu storage holds it, then freed by its own deleter. Live
// ones form a list (deviceOf walks it; adopting and freeing are O(1) and allocate nothing: spent
// records are kept per thread for the next result).
struct AdoptedBlock {
  c10::DataPtr owned;    // the kernel's block, when the kernel storage gave it up
  c10::Storage shared;   // else the kernel storage that still holds it
  const void* data = nullptr;
  size_t size = 0;
  int device = 0;
  AdoptedBlock* prev = nullptr;
  AdoptedBlock* next = nullptr;
};

// All state behind one mutex: allocation is far cheaper than the kernels it feeds.
struct State {
  std::mutex mu;
  std::unordered_map<void*, Block> live;
  std::vector<std::map<size_t, std::vector<void*>>> cached;  // per device: size -> blocks
  std::vector<DeviceStats> stats;
  AdoptedBlock* adopted = nullptr;  // head of the live adopted blocks

  void ensure(int device) {
    if (static_cast<int>(stats.size()) <= device) {
      stats.resize(device + 1);
      cached.resize(device + 1);
    }
  }
  void releaseCached(int device) {
    for (auto& [size, ptrs] : cached[device]) {
      for (void* p : ptrs) {
        vendor().free(p, device);
        countSegmentFree(stats[device], size);
        stats[device].num_device_free++;
      }
    }
    cached[device].clear();
  }
};

State& state() {
  static State* s = new State();  // leaked: blocks may be freed during static destruction
  return *s;
}

void freeBlock(void* ptr) {
  if (!ptr) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.live.find(ptr);
  TORCH_INTERNAL_ASSERT(it != s.live.end(), "ditorch: freeing a pointer the device allocator does not own");
  Block b = it->second;
  s.live.erase(it);
  DeviceStats& st = s.stats[b.device];
  countFree(st, b.size, b.requested);
  if (!vendor().cachesMemory()) {
    s.cached[b.device][b.size].push_back(ptr);
    return;
  }
  countSegmentFree(st, b.size);
  st.num_device_free++;
  vendor().free(ptr, b.device);
}

// Spent AdoptedBlock records kept for the next adoption on this thread (a result freed on another
// thread leaves its record there).
void deleteAdoptedRecord(AdoptedBlock* const& block) { delete block; }
thread_local ThreadSpares<AdoptedBlock*, 64, &deleteAdoptedRecord> t_spare_adopted;

AdoptedBlock* newAdoptedBlock() {
  AdoptedBlock* b;
  return t_spare_adopted.pop(b) ? b : new AdoptedBlock();
}

void recycleAdoptedBlock(AdoptedBlock* block) {
  // The vendor's block goes back to its own allocator here, outside our lock.
  block->owned.clear();
  block->shared = c10::Storage();
  if (!t_spare_adopted.push(block)) delete block;
}

void freeAdopted(void* context) {
  auto* block = static_cast<AdoptedBlock*>(context);
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    (block->prev ? block->prev->next : s.adopted) = block->next;
    if (block->next) block->next->prev = block->prev;
    DeviceStats& st = s.stats[block->device];
    countFree(st, block->size, block->size);
    countSegmentFree(st, block->size);
  }
  recycleAdoptedBlock(block);
}

thread_local int t_kernel_device = -1;

// The CPU allocator while ditorch is loaded: plain CPU memory, except inside a shim kernel.
class KernelHostAllocator final : public c10::Allocator {
 public:
  explicit KernelHostAllocator(c10::Allocator* original) : original_(original) {}
  c10::DataPtr allocate(size_t bytes) override {
    if (t_kernel_device < 0) return original_->allocate(bytes);
    c10::DataPtr block = deviceAllocator().allocateOn(bytes, t_kernel_device, c10::Device(c10::DeviceType::CPU));
    // The kernel writes it now: open for the rest of the op where memory is protected.
    if (MemoryWindow* window = MemoryWindow::current()) window->open(block.get());
    return block;
  }
  c10::DeleterFnPtr raw_deleter() const override { return &rawDelete; }
  void copy_data(void* dst, const void* src, std::size_t bytes) const override { original_->copy_data(dst, src, bytes); }

 private:
  static void rawDelete(void* ptr) {
    if (deviceAllocator().owns(ptr)) freeBlock(ptr);
    else original()->raw_deleter()(ptr);
  }
  static c10::Allocator*& original() {
    static c10::Allocator* o = nullptr;
    return o;
  }
  c10::Allocator* original_;
  friend void ditorch::installKernelHostAllocator();
};

}  // namespace

c10::DataPtr DeviceAllocator::allocate(size_t bytes) {
  int device = currentDevice();
  return allocateOn(bytes, device, c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)));
}

c10::DataPtr DeviceAllocator::allocateOn(size_t bytes, int device, c10::Device tag) {
  if (bytes == 0) return c10::DataPtr(nullptr, nullptr, &freeBlock, tag);
  const size_t size = roundSize(bytes);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.ensure(device);
  DeviceStats& st = s.stats[device];
  void* ptr = nullptr;
  size_t block_size = size;
  auto& cache = s.cached[device];
  // Reuse a cached block unless it would waste more than a quarter of itself.
  auto it = cache.lower_bound(size);
  if (it != cache.end() && it->first <= size + size / 4) {
    ptr = it->second.back();
    it->second.pop_back();
    block_size = it->first;
    if (it->second.empty()) cache.erase(it);
  } else {
    const int64_t capacity = chipProfile().memory_bytes;
    if (capacity > 0 && st.reserved_bytes[0].current + static_cast<int64_t>(size) > capacity) s.releaseCached(device);
    if (capacity > 0 && st.reserved_bytes[0].current + static_cast<int64_t>(size) > capacity) {
      st.num_ooms++;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "DIPU out of memory. Tried to allocate ", formatBytes(size),
                       " on dipu:", device, " (chip '", chipProfile().name, "' with ", formatBytes(capacity),
                       " total capacity; ", formatBytes(st.allocated_bytes[0].current), " already allocated; ",
                       formatBytes(st.reserved_bytes[0].current), " reserved in total by ditorch).");
    }
    ptr = vendor().malloc(size, device);
    if (!ptr) {
      st.num_alloc_retries++;
      s.releaseCached(device);
      ptr = vendor().malloc(size, device);
    }
    if (!ptr) {
      st.num_ooms++;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "DIPU out of memory. The ", vendor().name(),
                       " vendor could not allocate ", formatBytes(size), " on dipu:", device, ".");
    }
    countSegment(st, size);
    st.num_device_alloc++;
  }
  s.live.emplace(ptr, Block{block_size, bytes, device});
  countAllocation(st, block_size, bytes);
  // context == data so raw_allocate/raw_deleter work (the host allocator role needs them).
  return c10::DataPtr(ptr, ptr, &freeBlock, tag);
}

c10::DataPtr DeviceAllocator::adopt(c10::DataPtr owned, c10::Storage shared, size_t bytes, int device) {
  void* data = owned ? owned.get() : shared.mutable_data();
  const c10::Device tag(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device));
  if (!data) return c10::DataPtr(nullptr, tag);
  AdoptedBlock* block = newAdoptedBlock();
  block->owned = std::move(owned);
  block->shared = std::move(shared);
  block->data = data;
  block->size = bytes;
  block->device = device;
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  s.ensure(device);
  DeviceStats& st = s.stats[device];
  const int64_t capacity = chipProfile().memory_bytes;
  if (capacity > 0 && st.reserved_bytes[0].current + static_cast<int64_t>(bytes) > capacity) {
    st.num_ooms++;
    const int64_t allocated = st.allocated_bytes[0].current;
    lock.unlock();
    recycleAdoptedBlock(block);  // the result is refused: its memory goes back now
    TORCH_CHECK_WITH(OutOfMemoryError, false, "DIPU out of memory. A kernel's result of ", formatBytes(bytes),
                     " on dipu:", device, " does not fit chip '", chipProfile().name, "' with ", formatBytes(capacity),
                     " total capacity; ", formatBytes(allocated), " already allocated.");
  }
  block->prev = nullptr;
  block->next = s.adopted;
  if (s.adopted) s.adopted->prev = block;
  s.adopted = block;
  countSegment(st, bytes);
  countAllocation(st, bytes, bytes);
  return c10::DataPtr(data, block, &freeAdopted, tag);
}

c10::DataPtr DeviceAllocator::copyToNewBlock(const void* src, size_t copy_bytes, size_t bytes, int device,
                                             c10::Device tag) {
  TORCH_INTERNAL_ASSERT(copy_bytes <= bytes, "copying ", copy_bytes, " bytes into a block of ", bytes);
  c10::DataPtr block = allocateOn(bytes, device, tag);
  if (copy_bytes) vendor().memcpy(block.get(), src, copy_bytes, CopyKind::DeviceToDevice, device);
  return block;
}

void resizeDeviceStorage(c10::StorageImpl* storage, size_t nbytes) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  const size_t common = std::min(nbytes, storage->nbytes());
  storage->set_data_ptr_noswap(deviceAllocator().copyToNewBlock(storage->data(), common, nbytes,
                                                                storage->device().index(), storage->device()));
  storage->set_nbytes(nbytes);
}

c10::DeleterFnPtr DeviceAllocator::raw_deleter() const { return &freeBlock; }

void DeviceAllocator::copy_data(void* dst, const void* src, std::size_t bytes) const {
  vendor().memcpy(dst, src, bytes, CopyKind::DeviceToDevice, currentDevice());
}

bool DeviceAllocator::isBlock(const c10::DataPtr& p) {
  return p.get() != nullptr && p.get_deleter() == &freeBlock && p.get_context() == p.get();
}

int DeviceAllocator::deviceOf(const void* ptr) const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.live.find(const_cast<void*>(ptr));
  if (it != s.live.end()) return it->second.device;
  for (const AdoptedBlock* b = s.adopted; b; b = b->next)
    if (b->data == ptr) return b->device;
  return -1;
}

DeviceStats DeviceAllocator::getDeviceStats(c10::DeviceIndex device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.ensure(device);
  return s.stats[device];
}

void DeviceAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.ensure(device);
  DeviceStats& st = s.stats[device];
  forEachStat(st, [](c10::CachingAllocator::Stat& stat) { stat.reset_accumulated(); });
  st.num_alloc_retries = 0;
  st.num_ooms = 0;
  st.num_sync_all_streams = 0;
  st.num_device_alloc = 0;
  st.num_device_free = 0;
}

void DeviceAllocator::resetPeakStats(c10::DeviceIndex device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.ensure(device);
  forEachStat(s.stats[device], [](c10::CachingAllocator::Stat& stat) { stat.reset_peak(); });
}

void DeviceAllocator::emptyCache(c10::MempoolId_t /*mempool_id: dipu has no private pools*/) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (int d = 0; d < static_cast<int>(s.cached.size()); ++d) s.releaseCached(d);
}

void DeviceAllocator::recordStream(const c10::DataPtr& ptr, c10::Stream stream) {
  if (!ptr.get() || !vendor().streamRuntime()) return;
  if (isBlock(ptr)) return vendor().recordStream(ptr.get(), nullptr, toNativeStream(stream));
  if (ptr.get_deleter() == &freeAdopted) {
    const auto* block = static_cast<const AdoptedBlock*>(ptr.get_context());
    vendor().recordStream(ptr.get(), block->owned ? &block->owned : &block->shared.data_ptr(), toNativeStream(stream));
  }
}

std::pair<size_t, size_t> DeviceAllocator::getMemoryInfo(c10::DeviceIndex device) {
  checkDevice(device);
  auto [device_free, device_total] = vendor().memoryInfo(device);
  const bool device_limits = device_total > 0;  // a native vendor's device; emu's is the chip alone
  if (!device_limits) {
    // Emu's device memory is host memory: an unlimited chip (the host profile) has the host's.
    const auto page = static_cast<size_t>(sysconf(_SC_PAGE_SIZE));
    device_free = page * static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES));
    device_total = page * static_cast<size_t>(sysconf(_SC_PHYS_PAGES));
  }
  const auto capacity = static_cast<size_t>(std::max<int64_t>(chipProfile().memory_bytes, 0));
  size_t total = device_total;
  if (capacity > 0) total = device_limits ? std::min(capacity, device_total) : capacity;
  const auto reserved = static_cast<size_t>(getDeviceStats(device).reserved_bytes[0].current);
  size_t free = total > reserved ? total - reserved : 0;
  if (device_limits || capacity == 0) free = std::min(free, device_free);
  return {free, total};
}

DeviceAllocator& deviceAllocator() {
  static DeviceAllocator allocator;
  return allocator;
}

KernelAllocationScope::KernelAllocationScope(int device) : previous_(t_kernel_device) {
  if (kernelAllocationsRedirected()) t_kernel_device = device;
}
KernelAllocationScope::~KernelAllocationScope() { t_kernel_device = previous_; }

void installKernelHostAllocator() {
  static bool installed = false;
  if (installed) return;
  installed = true;
  c10::Allocator* original = c10::GetCPUAllocator();
  KernelHostAllocator::original() = original;
  static KernelHostAllocator host(original);
  // Priority above the default registration so later default registrations cannot undo it.
  c10::SetCPUAllocator(&host, /*priority=*/100);
}

}  // namespace ditorch
