// DiComm's debug log: DICOMM_DEBUG=INFO prints what the library decided (listen address,
// transports, collective algorithms) to stderr, one line each; WARN (the default) prints only
// what a user must act on. Like NCCL_DEBUG, so that a quiet run stays quiet.
#pragma once

#include <string>

namespace dicomm {

enum class LogLevel { kWarn = 0, kInfo = 1 };

// Whether messages of `level` are printed (DICOMM_DEBUG, read once; a bad value is an error).
bool logEnabled(LogLevel level);
// Print "dicomm INFO: <text>" (or WARN) with the pid when `level` is enabled.
void logLine(LogLevel level, const std::string& text);

}  // namespace dicomm
