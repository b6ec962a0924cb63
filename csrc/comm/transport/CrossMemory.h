// Cross-memory attach: one process reads another's memory with process_vm_readv. `shm` copies a
// large payload this way, straight from the sender's buffer into the receiver's: one copy, no
// kernel socket buffers.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace dicomm {

// Reads `n` bytes at address `src` of process `pid` into `dst`; 0, or the errno that stopped it.
// `twoThreads` copies a large payload (4 MiB and up) with a helper thread: one process_vm_readv
// stream stays well under memcpy speed, but with more ranks than cores a helper only adds
// switches (StreamConfig::parallelPull).
int readProcessMemory(pid_t pid, void* dst, uint64_t src, size_t n, bool twoThreads = false);

// Whether this process may read sibling processes' memory (probed on itself).
bool crossMemoryAttachWorks();

// A process proves to a peer that cross-memory attach works between them: it sends the address
// of a word every process holds with the same value (its Hello's `probe`), and the peer reads
// it back with probeReads().
uint64_t probeAddress();
bool probeReads(pid_t pid, uint64_t address);

// Lets processes of this user read this one while the returned token is held, where Yama
// (ptrace_scope=1) would otherwise forbid it; null where nothing needs declaring.
std::shared_ptr<void> allowSiblingReads();

}  // namespace dicomm
