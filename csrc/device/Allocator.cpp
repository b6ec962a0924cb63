#include "device/Allocator.h"

#include "device/ChipProfile.h"
#include "device/Guard.h"
#include "device/MemoryWindow.h"
#include "device/vendor/Vendor.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>

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

struct Block {
  size_t size;
  int device;
};

// All state behind one mutex: allocation is far cheaper than the kernels it feeds.
struct State {
  std::mutex mu;
  std::unordered_map<void*, Block> live;
  std::vector<std::map<size_t, std::vector<void*>>> cached;  // per device: size -> blocks
  std::vector<MemoryStats> stats;
  std::unordered_map<const void*, std::pair<int, int>> adopted;  // adopted block -> (device, dipu storages over it)

  void ensure(int device) {
    if (static_cast<int>(stats.size()) <= device) {
      stats.resize(device + 1);
      cached.resize(device + 1);
    }
  }
  void releaseCached(int device) {
    for (auto& [size, ptrs] : cached[device]) {
      for (void* p : ptrs) vendor().free(p, device);
      stats[device].reserved -= static_cast<int64_t>(size * ptrs.size());
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
  MemoryStats& st = s.stats[b.device];
  st.allocated -= static_cast<int64_t>(b.size);
  st.num_frees++;
  if (!vendor().cachesMemory()) {
    s.cached[b.device][b.size].push_back(ptr);
    return;
  }
  st.reserved -= static_cast<int64_t>(b.size);
  vendor().free(ptr, b.device);
}

// A kernel result in the vendor's own memory, adopted as a dipu block as it is (no copy): counted
// in its device's statistics while the dipu storage holds it, then freed by its own deleter.
struct AdoptedBlock {
  c10::DataPtr owned;    // the kernel's block, when the kernel storage gave it up
  c10::Storage shared;   // else the kernel storage that still holds it
  size_t size;
  int device;
};

void freeAdopted(void* context) {
  std::unique_ptr<AdoptedBlock> block(static_cast<AdoptedBlock*>(context));
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const void* ptr = block->owned ? block->owned.get() : block->shared.data();
  auto it = s.adopted.find(ptr);
  if (it != s.adopted.end() && --it->second.second == 0) s.adopted.erase(it);
  MemoryStats& st = s.stats[block->device];
  st.allocated -= static_cast<int64_t>(block->size);
  st.reserved -= static_cast<int64_t>(block->size);
  st.num_frees++;
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
  MemoryStats& st = s.stats[device];
  void* ptr = nullptr;
  auto& cache = s.cached[device];
  // Reuse a cached block unless it would waste more than a quarter of itself.
  auto it = cache.lower_bound(size);
  if (it != cache.end() && it->first <= size + size / 4) {
    ptr = it->second.back();
    it->second.pop_back();
    Block b{it->first, device};
    if (it->second.empty()) cache.erase(it);
    s.live.emplace(ptr, b);
    st.allocated += static_cast<int64_t>(b.size);
    st.num_cache_hits++;
  } else {
    const int64_t capacity = chipProfile().memory_bytes;
    if (capacity > 0 && st.reserved + static_cast<int64_t>(size) > capacity) s.releaseCached(device);
    if (capacity > 0 && st.reserved + static_cast<int64_t>(size) > capacity) {
      st.num_ooms++;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "DIPU out of memory. Tried to allocate ", formatBytes(size),
                       " on dipu:", device, " (chip '", chipProfile().name, "' with ", formatBytes(capacity),
                       " total capacity; ", formatBytes(st.allocated), " already allocated; ",
                       formatBytes(st.reserved), " reserved in total by ditorch).");
    }
    ptr = vendor().malloc(size, device);
    if (!ptr) {
      s.releaseCached(device);
      ptr = vendor().malloc(size, device);
    }
    if (!ptr) {
      st.num_ooms++;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "DIPU out of memory. The ", vendor().name(),
                       " vendor could not allocate ", formatBytes(size), " on dipu:", device, ".");
    }
    s.live.emplace(ptr, Block{size, device});
    st.reserved += static_cast<int64_t>(size);
    st.allocated += static_cast<int64_t>(size);
  }
  st.num_allocs++;
  st.peak_allocated = std::max(st.peak_allocated, st.allocated);
  st.peak_reserved = std::max(st.peak_reserved, st.reserved);
  // context == data so raw_allocate/raw_deleter work (the host allocator role needs them).
  return c10::DataPtr(ptr, ptr, &freeBlock, tag);
}

c10::DataPtr DeviceAllocator::adopt(c10::DataPtr owned, c10::Storage shared, size_t bytes, int device) {
  void* data = owned ? owned.get() : shared.mutable_data();
  const c10::Device tag(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device));
  if (!data) return c10::DataPtr(nullptr, tag);
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.ensure(device);
    MemoryStats& st = s.stats[device];
    const int64_t capacity = chipProfile().memory_bytes;
    if (capacity > 0 && st.reserved + static_cast<int64_t>(bytes) > capacity) {
      st.num_ooms++;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "DIPU out of memory. A kernel's result of ", formatBytes(bytes),
                       " on dipu:", device, " does not fit chip '", chipProfile().name, "' with ", formatBytes(capacity),
                       " total capacity; ", formatBytes(st.allocated), " already allocated.");
    }
    auto [it, first] = s.adopted.try_emplace(data, device, 0);
    it->second.second++;
    st.allocated += static_cast<int64_t>(bytes);
    st.reserved += static_cast<int64_t>(bytes);
    st.num_allocs++;
    st.peak_allocated = std::max(st.peak_allocated, st.allocated);
    st.peak_reserved = std::max(st.peak_reserved, st.reserved);
  }
  auto* block = new AdoptedBlock{std::move(owned), std::move(shared), bytes, device};
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

bool DeviceAllocator::owns(const void* ptr) const { return deviceOf(ptr) >= 0; }

bool DeviceAllocator::isBlock(const c10::DataPtr& p) {
  return p.get() != nullptr && p.get_deleter() == &freeBlock && p.get_context() == p.get();
}

int DeviceAllocator::deviceOf(const void* ptr) const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.live.find(const_cast<void*>(ptr));
  if (it != s.live.end()) return it->second.device;
  auto adopted = s.adopted.find(ptr);
  return adopted == s.adopted.end() ? -1 : adopted->second.first;
}

MemoryStats DeviceAllocator::stats(int device) const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.ensure(device);
  return s.stats[device];
}

void DeviceAllocator::resetPeakStats(int device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.ensure(device);
  s.stats[device].peak_allocated = s.stats[device].allocated;
  s.stats[device].peak_reserved = s.stats[device].reserved;
}

void DeviceAllocator::emptyCache() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (int d = 0; d < static_cast<int>(s.cached.size()); ++d) s.releaseCached(d);
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
