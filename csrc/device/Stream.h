#pragma once
// Streams. On a vendor with a stream runtime (native cuda) a dipu stream is the runtime's stream of
// the same id on the kernel device, and the runtime's current stream is the dipu one, so kernels
// the shim re-dispatches run on it. A synchronous vendor (emu, native cpu) runs every kernel on
// the calling thread, so a stream is always drained: there streams are ids per device with a
// current one per thread, which still order and name work so the same program runs on both.
#include <c10/core/Stream.h>

namespace ditorch {

c10::Stream defaultStream(int device);
c10::Stream currentStream(int device);
c10::Stream newStream(int device, int priority);
// Makes `stream` current on its device and returns the previous current stream there.
c10::Stream exchangeStream(c10::Stream stream);
// The runtime's stream behind a dipu stream, and back (vendors with a stream runtime).
c10::Stream toNativeStream(const c10::Stream& stream);
c10::Stream toDipuStream(const c10::Stream& stream);

}  // namespace ditorch
