#include "device/vendor/ProtectedMemory.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

namespace ditorch {
namespace {

std::size_t pageRound(std::size_t bytes) {
  static const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

}  // namespace

void* ProtectedMemory::allocate(std::size_t bytes) {
  const std::size_t size = pageRound(bytes ? bytes : 1);
  void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  blocks_[reinterpret_cast<std::uintptr_t>(p)] = Block{size, next_token_++, 0};
  return p;
}

void ProtectedMemory::free(void* ptr) {
  std::size_t size;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
    TORCH_INTERNAL_ASSERT(it != blocks_.end(), "ditorch: freeing device memory that was not allocated");
    size = it->second.bytes;
    blocks_.erase(it);
  }
  munmap(ptr, size);
}

std::map<std::uintptr_t, ProtectedMemory::Block>::iterator ProtectedMemory::find(const void* ptr) {
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = blocks_.upper_bound(address);
  if (it == blocks_.begin()) return blocks_.end();
  --it;
  return address < it->first + it->second.bytes ? it : blocks_.end();
}

std::uint64_t ProtectedMemory::open(const void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = find(ptr);
  if (it == blocks_.end()) return 0;
  Block& b = it->second;
  if (b.opens == 0)
    TORCH_CHECK(mprotect(reinterpret_cast<void*>(it->first), b.bytes, PROT_READ | PROT_WRITE) == 0,
                "ditorch: opening ", b.bytes, " bytes of protected device memory failed: ", std::strerror(errno));
  ++b.opens;
  return b.token;
}

void ProtectedMemory::close(const void* ptr, std::uint64_t token) {
  if (token == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = find(ptr);
  if (it == blocks_.end() || it->second.token != token || it->second.opens == 0) return;
  // (Called from destructors: a failure leaves the block readable, less protected but correct.)
  if (--it->second.opens == 0) (void)mprotect(reinterpret_cast<void*>(it->first), it->second.bytes, PROT_NONE);
}

}  // namespace ditorch
