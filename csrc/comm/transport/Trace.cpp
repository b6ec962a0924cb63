#include "comm/transport/Trace.h"

#include <time.h>

#include <cstdlib>
#include <cstring>

namespace dicomm {
namespace trace {

namespace detail {
std::atomic<int64_t> stamps[kPoints];

int64_t nowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}
}  // namespace detail

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("DICOMM_TRACE");
    return v && std::strcmp(v, "1") == 0;
  }();
  return on;
}

std::vector<std::pair<std::string, int64_t>> take() {
  static const char* const names[kPoints] = {
      "send.call",   "send.posted", "send.written", "send.wait_in", "send.wait_out", "recv.call",
      "recv.posted", "recv.wait_in", "recv.frame",  "recv.landed",  "recv.wait_out", "wait.blocks"};
  std::vector<std::pair<std::string, int64_t>> out;
  for (int p = 0; p < kPoints; ++p) {
    out.emplace_back(names[p], detail::stamps[p].exchange(0, std::memory_order_relaxed));
  }
  return out;
}

}  // namespace trace
}  // namespace dicomm
