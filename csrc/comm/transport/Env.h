// Tuning knobs read from the environment (DICOMM_*), validated: a bad value is an error that
// names the variable and the accepted range, never silently ignored.
#pragma once

#include <chrono>

namespace dicomm {

// The integer value of `name`, or `fallback` when unset or empty. Throws std::invalid_argument
// naming the variable when the value is not an integer in [lo, hi].
long envLong(const char* name, long fallback, long lo, long hi);

// How long a thread that waits for the network polls before it sleeps (DICOMM_SPIN_US, read
// once). Waking a sleeping thread costs tens of microseconds on a VM whose idle vCPUs halt, more
// than a small message's whole trip; polling past the next message keeps a ping-pong awake.
std::chrono::microseconds spinBudget();

}  // namespace dicomm
