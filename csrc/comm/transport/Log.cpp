#include "comm/transport/Log.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace dicomm {

namespace {

LogLevel configuredLevel() {
  const char* v = std::getenv("DICOMM_DEBUG");
  if (!v || !*v) return LogLevel::kWarn;
  const std::string s(v);
  if (s == "WARN" || s == "warn") return LogLevel::kWarn;
  if (s == "INFO" || s == "info") return LogLevel::kInfo;
  throw std::invalid_argument("dicomm: DICOMM_DEBUG='" + s + "': expected WARN or INFO");
}

}  // namespace

bool logEnabled(LogLevel level) {
  static const LogLevel configured = configuredLevel();
  return static_cast<int>(level) <= static_cast<int>(configured);
}

void logLine(LogLevel level, const std::string& text) {
  if (!logEnabled(level)) return;
  // One fprintf per line keeps lines of concurrent ranks whole.
  std::fprintf(stderr, "dicomm %s [pid %d]: %s\n", level == LogLevel::kInfo ? "INFO" : "WARN",
               static_cast<int>(getpid()), text.c_str());
}

}  // namespace dicomm
