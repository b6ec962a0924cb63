#pragma once
// Streams: ids per device, a current stream per thread and device. The emu vendor runs every
// kernel synchronously, so a stream is always drained; the ids still order and name work so
// the same program runs unchanged on an asynchronous vendor.
#include <c10/core/Stream.h>

namespace ditorch {

c10::Stream defaultStream(int device);
c10::Stream currentStream(int device);
c10::Stream newStream(int device, int priority);
// Makes `stream` current on its device and returns the previous current stream there.
c10::Stream exchangeStream(c10::Stream stream);

}  // namespace ditorch
