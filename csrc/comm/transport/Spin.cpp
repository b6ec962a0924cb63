#include "comm/transport/Spin.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <chrono>
#include <mutex>
#include <thread>

#include "comm/transport/Env.h"
#include "comm/transport/Log.h"

namespace dicomm {

namespace {

constexpr int64_t kSampleEveryNs = 1'000'000;
constexpr double kWeight = 0.3;  // of the newest sample in the running average

std::atomic<int> pollersHere{0};

int usableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return CPU_COUNT(&set);
}

// Runnable threads on the host right now (the 4th field of /proc/loadavg: "running/total"),
// or -1 when it cannot be read.
int runnableThreads() {
  static const int fd = ::open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buf[128];
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return -1;
  buf[n] = '\0';
  double a, b, c;
  int running = -1;
  if (std::sscanf(buf, "%lf %lf %lf %d/", &a, &b, &c, &running) != 4) return -1;
  return running;
}

std::atomic<bool> busy{false};

}  // namespace

void sampleHostLoad(bool callerPolls) {
  static const int cores = usableCores();
  static std::atomic<int64_t> sampledAt{0};
  static std::mutex mu;
  static double average = 0;
  static int64_t lastLogged = 0;
  const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
  int64_t last = sampledAt.load(std::memory_order_relaxed);
  if (now - last < kSampleEveryNs ||
      !sampledAt.compare_exchange_strong(last, now, std::memory_order_relaxed)) {
    return;
  }
  const int running = runnableThreads();
  if (running < 0) return;
  std::lock_guard<std::mutex> lock(mu);
  // Other runnable threads: not this process's pollers, nor the caller.
  const int others = running - pollersHere.load() - (callerPolls ? 0 : 1);
  average += kWeight * (others - average);
  const bool nowBusy = average > cores + 0.5;
  if (busy.exchange(nowBusy, std::memory_order_relaxed) != nowBusy && logEnabled(LogLevel::kInfo) &&
      now - lastLogged >= 1'000'000'000) {
    lastLogged = now;  // at most one line a second: the state may flicker at the edge
    char text[160];
    std::snprintf(text, sizeof(text), "host %s: %.1f other runnable threads on %d cores; waiters %s",
                  nowBusy ? "busy" : "quiet", average, cores,
                  nowBusy ? "block instead of polling" : "poll before blocking");
    logLine(LogLevel::kInfo, text);
  }
}

bool hostBusy() { return busy.load(std::memory_order_relaxed); }

PollPhase::PollPhase() {
  const auto ceiling = spinBudget();
  if (ceiling.count() == 0) return;
  // A busy host's waiters do not poll, so they sample here, on their way to block (where a
  // system call costs little against the wake-up to come): else nobody would see it quieten.
  if (hostBusy()) sampleHostLoad(/*callerPolls=*/false);
  if (hostBusy()) return;
  budget_ = ceiling;
  pollersHere.fetch_add(1, std::memory_order_relaxed);
}

PollPhase::~PollPhase() {
  if (budget_.count() > 0) pollersHere.fetch_sub(1, std::memory_order_relaxed);
}

void relax(unsigned round) {
  if (round == 0) sampleHostLoad(/*callerPolls=*/true);
  if (round % 16 == 15) {
    std::this_thread::yield();
    return;
  }
  const auto stop = std::chrono::steady_clock::now() + std::chrono::microseconds(1);
  while (std::chrono::steady_clock::now() < stop) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
}

}  // namespace dicomm
