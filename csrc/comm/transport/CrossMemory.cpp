#include "comm/transport/CrossMemory.h"

#include <errno.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstdio>
#include <mutex>
#include <thread>

#include "comm/transport/Handshake.h"

namespace dicomm {

namespace {

// A word every process owns at a known address: the peer reads it back to prove that
// process_vm_readv works between the two processes before trusting the REMOTE protocol.
const uint64_t kProbeWord = kHelloMagic;

// process_vm_readv until all n bytes are in; returns 0 or errno.
int readAll(pid_t pid, void* dst, uint64_t src, size_t n) {
  char* d = static_cast<char*>(dst);
  while (n > 0) {
    iovec local{d, n};
    iovec remote{reinterpret_cast<void*>(src), n};
    ssize_t k = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (k == 0) return EFAULT;
    d += k;
    src += static_cast<uint64_t>(k);
    n -= static_cast<size_t>(k);
  }
  return 0;
}

// Yama's ptrace_scope (0 when Yama is absent).
int yamaScope() {
  FILE* f = std::fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  if (!f) return 0;
  int scope = 0;
  if (std::fscanf(f, "%d", &scope) != 1) scope = 0;
  std::fclose(f);
  return scope;
}

}  // namespace

int readProcessMemory(pid_t pid, void* dst, uint64_t src, size_t n, bool twoThreads) {
  constexpr size_t kSplitAt = 4 << 20;
  if (!twoThreads || n < kSplitAt) return readAll(pid, dst, src, n);
  const size_t half = (n / 2 + 4095) & ~size_t(4095);
  int err2 = 0;
  std::thread helper([&] { err2 = readAll(pid, static_cast<char*>(dst) + half, src + half, n - half); });
  const int err = readAll(pid, dst, src, half);
  helper.join();
  return err ? err : err2;
}

bool crossMemoryAttachWorks() { return probeReads(getpid(), probeAddress()); }

uint64_t probeAddress() { return reinterpret_cast<uint64_t>(&kProbeWord); }

bool probeReads(pid_t pid, uint64_t address) {
  uint64_t got = 0;
  return readAll(pid, &got, address, sizeof(got)) == 0 && got == kProbeWord;
}

// Under Yama ptrace_scope=1 only a declared tracer may read this process's memory, and
// PR_SET_PTRACER names one pid while a rank has several local peers: so any process of this
// user is declared, for as long as a shm transport lives (the token), and only where Yama asks
// for it (scope 0 already allows same-user reads; 2 and 3 forbid them whatever is declared).
// Peers are still checked at connect: pid and uid from the socket (SO_PEERCRED).
std::shared_ptr<void> allowSiblingReads() {
  static std::mutex mu;
  static std::weak_ptr<void> current;
  std::lock_guard<std::mutex> lock(mu);
  if (auto held = current.lock()) return held;
  if (yamaScope() != 1) return nullptr;
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  std::shared_ptr<void> token(nullptr, [](void*) {
    std::lock_guard<std::mutex> lock(mu);
    prctl(PR_SET_PTRACER, 0, 0, 0, 0);
  });
  current = token;
  return token;
}

}  // namespace dicomm
