// dicomm's polling threads on this host, counted per process in a small table that every dicomm
// process of this user maps (/dev/shm/dicomm-pollers-<uid>).
//
// A waiter polls only while the host has a core no real work needs (Spin.h), and the kernel's
// count of runnable threads includes every poller on the host. A process knows its own pollers;
// the table tells it the others', so that two ranks polling for each other's messages do not read
// as a busy host. Each process takes a slot (its pid and its current count) the first time it
// polls: a free slot, or one whose process has died. A process that dies while polling leaves its
// count behind, so a count is believed only while its process lives. A table that cannot be opened
// (no /dev/shm, a file of another owner or size) or has no free slot leaves only this process's
// own pollers known, as if it were alone on the host.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace dicomm {

class HostPollers {
 public:
  static constexpr int kSlots = 256;
  // A slot's count is believed up to this (a process's waiters and receive threads); beyond it
  // the slot is read as garbage from a process that reused a dead one's pid.
  static constexpr int kMaxPerProcess = 16;

  // The table in the shared-memory file at `path`, created 0600 if absent.
  explicit HostPollers(const std::string& path);
  ~HostPollers();
  HostPollers(const HostPollers&) = delete;
  HostPollers& operator=(const HostPollers&) = delete;

  // Whether the table is mapped (else add() does nothing and others() is 0).
  bool usable() const { return slots_ != nullptr; }
  // A thread of this process starts (+1) or stops (-1) polling.
  void add(int delta);
  // Polling threads of the other live processes in the table.
  int others() const;

 private:
  struct Slot {
    std::atomic<int32_t> pid;
    std::atomic<int32_t> pollers;
  };
  Slot* claim();

  Slot* slots_ = nullptr;
  Slot* mine_ = nullptr;  // taken on first add(); a forked child takes its own
  int32_t pid_ = 0;
};

// This user's table, opened on first use.
HostPollers& hostPollers();

}  // namespace dicomm
