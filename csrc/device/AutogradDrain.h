#pragma once
// Letting autograd's dipu device threads finish before the interpreter does.
#include <cstdint>
#include <vector>

namespace ditorch {

// Runs a one-element backward on each of `devices` from a thread of its own (empty thread-local
// state) and waits for it. Autograd's device thread for a dipu device drops its last graph task
// after waking the caller of backward(); that graph task holds the caller's thread-local state,
// Python modes among them, so dropping it takes the GIL. Run at interpreter exit, it met a
// finalizing interpreter, which ends a thread that asks for the GIL with pthread_exit, whose
// unwinding through autograd's noexcept frames called std::terminate ("terminate called without
// an active exception", an abort). A device thread runs its tasks in order, so once this task is
// done it has dropped every earlier one; this one holds no Python object. Call it without the
// GIL.
void drainAutogradDeviceThreads(const std::vector<int64_t>& devices);

}  // namespace ditorch
