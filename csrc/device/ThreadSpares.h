#pragma once
// A per-thread stack of spare objects the shim re-uses from one op to the next (alias tensors,
// adopted-block records), to be declared `thread_local`.
//
// Why not a thread_local container: a thread-local with a destructor is reached through a TLS
// wrapper call that checks its initialisation on every access, and the shim touches these on
// every op. This one is constant-initialised and trivially destructible, so an access is a plain
// TLS address; what it still holds when the thread exits is handed to `Release` by a second
// thread-local, registered once, on the thread's first push.
#include <cstddef>

namespace ditorch {

// `T` is trivially copyable (raw pointers that own what they point to); `Release` frees one. One
// pool per instantiation per thread.
template <class T, std::size_t N, void (*Release)(const T&)>
class ThreadSpares {
 public:
  // Takes the newest spare into `out`; false when there is none.
  bool pop(T& out) {
    if (size_ == 0) return false;
    out = slots_[--size_];
    return true;
  }
  // Keeps `v`; false (nothing kept) when the pool is full or its thread is exiting.
  bool push(const T& v) {
    if (size_ == N || state_ == State::kClosed) return false;
    if (state_ == State::kFresh) releaseAtThreadExit();
    slots_[size_++] = v;
    return true;
  }
  bool full() const { return size_ == N; }

 private:
  enum class State : unsigned char { kFresh, kRegistered, kClosed };

  void releaseAtThreadExit() {
    state_ = State::kRegistered;
    struct AtExit {
      ThreadSpares* pool;
      ~AtExit() {
        T v;
        while (pool->pop(v)) Release(v);
        pool->state_ = State::kClosed;  // what the thread frees after this is not kept
      }
    };
    static thread_local AtExit at_exit{this};
  }

  T slots_[N] = {};
  std::size_t size_ = 0;
  State state_ = State::kFresh;
};

}  // namespace ditorch
