#include "comm/transport/Env.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace dicomm {

long envLong(const char* name, long fallback, long lo, long hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < lo || x > hi) {
    throw std::invalid_argument(std::string("dicomm: ") + name + "='" + v +
                                "': expected an integer in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "]");
  }
  return x;
}

std::chrono::microseconds spinBudget() {
  static const std::chrono::microseconds budget(envLong("DICOMM_SPIN_US", 200, 0, 1000000));
  return budget;
}

}  // namespace dicomm
