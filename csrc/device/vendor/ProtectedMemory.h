#pragma once
// Device memory the host cannot read or write, for the emu vendor: each block is its own page
// range, kept PROT_NONE except while a kernel of the vendor works on it. Host code that
// dereferences a dipu pointer outside a kernel then crashes here as it would on an accelerator,
// instead of working on the emulator and failing on hardware (DITORCH_EMU_PROTECT_MEMORY=1).
//
// Opening is counted per block: two threads' kernels (the autograd engine's device thread beside
// the main one) may work on one block, and it closes when the last is done.
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

namespace ditorch {

class ProtectedMemory {
 public:
  void* allocate(std::size_t bytes);  // nullptr when out of memory
  void free(void* ptr);
  // Opens the block holding `ptr` (any address inside it) for reading and writing; returns its
  // token, 0 when `ptr` is not in a block of ours (host memory: nothing to open).
  std::uint64_t open(const void* ptr);
  // Closes what open(`ptr`) opened; a block freed since (token no longer matches) is left alone.
  void close(const void* ptr, std::uint64_t token);

 private:
  struct Block {
    std::size_t bytes;     // whole pages
    std::uint64_t token;   // unique per mapping
    int opens;
  };
  // The block holding `ptr`, or end(). Caller holds mu_.
  std::map<std::uintptr_t, Block>::iterator find(const void* ptr);

  std::mutex mu_;
  std::map<std::uintptr_t, Block> blocks_;  // by start address
  std::uint64_t next_token_ = 1;
};

}  // namespace ditorch
