// Tuning knobs read from the environment (DICOMM_*), validated: a bad value is an error that
// names the variable and the accepted range, never silently ignored.
#pragma once

namespace dicomm {

// The integer value of `name`, or `fallback` when unset or empty. Throws std::invalid_argument
// naming the variable when the value is not an integer in [lo, hi].
long envLong(const char* name, long fallback, long lo, long hi);

}  // namespace dicomm
