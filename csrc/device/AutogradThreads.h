#pragma once
// Autograd's device threads and dipu.
//
// PyTorch's autograd engine runs the backward of a non-CPU device on a thread of its own per
// device, so that a host can keep several accelerators' queues fed at once. On a vendor whose
// kernels run synchronously on the host (emu, native cpu) that thread overlaps nothing: the
// kernel is the host's work. It costs a hand-off per backward, and it moves the backward's
// kernels to another core, away from the forward's data in its cache, and onto another glibc
// arena (a div of 4 MiB of attention scores took 1.5x as long there as on CPU tensors; with one
// malloc arena for the process, about as long). Such a vendor runs backward on the calling
// thread, as CPU tensors do (docs/device.md, "Autograd's threads").
#include <cstdint>
#include <vector>

namespace ditorch {

namespace detail {
void decideBackwardThread();
// Defined here with its constant initialiser, so that a reader in another file reaches it without
// a call to a TLS init wrapper (it is read on every op).
inline thread_local bool t_backward_thread_chosen = false;
}  // namespace detail

// Called by the shim on every dipu op: where the vendor's kernels run on the host, the first on
// each thread outside a backward turns autograd's multithreading off for that thread
// (torch.autograd.set_multithreading_enabled(False)). The thread's later choice stands: a `with
// torch.autograd.set_multithreading_enabled(True)` block gets the device threads back.
inline void chooseBackwardThread() {
  if (__builtin_expect(!detail::t_backward_thread_chosen, 0)) detail::decideBackwardThread();
}

// Runs a one-element backward on each of `devices` from a thread of its own (empty thread-local
// state, autograd's multithreading on) and waits for it. Autograd's device thread for a dipu
// device drops its last graph task after waking the caller of backward(); that graph task holds
// the caller's thread-local state, Python modes among them, so dropping it takes the GIL. Run at
// interpreter exit, it met a finalizing interpreter, which ends a thread that asks for the GIL
// with pthread_exit, whose unwinding through autograd's noexcept frames called std::terminate
// ("terminate called without an active exception", an abort). A device thread runs its tasks in
// order, so once this task is done it has dropped every earlier one; this one holds no Python
// object. Call it without the GIL.
void drainAutogradDeviceThreads(const std::vector<int64_t>& devices);

}  // namespace ditorch
