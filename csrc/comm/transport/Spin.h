// How long a thread that waits for the network polls before it blocks in the kernel.
//
// Polling pays on a quiet host: waking a sleeping thread costs more than a small message's whole
// trip on a VM whose idle vCPUs halt, and a poller that runs out of time costs only a
// core nobody else wanted. On a busy host it is the worst thing to do: the poller holds a core
// that the thread it waits for, or the peer rank, needs (a training job beside the communication
// threads, or more ranks than cores). So a waiter polls for DICOMM_SPIN_US (default 200; 0 never
// polls) only while the host is quiet, and otherwise blocks at once, as gloo always does.
//
// "Quiet" is the kernel's count of runnable threads (/proc/loadavg), less this process's own
// pollers, averaged over a few samples (one per ms at most), at most the number of cores. Our
// pollers are subtracted because they are what polling costs, not a reason to stop; the average
// keeps a momentary peak (a peer's thread waking) from stopping the polls of a ping-pong. A
// thread's own history does not tell the two hosts apart: a poll that runs out says only that
// the wait was long, and context switches during polls happen on a quiet host too (our own
// threads take turns); an adaptive budget built on either collapsed small-message latency on a
// quiet host (docs/dicomm.md).
//
// A wait decides from the last sample and takes the next one only once it has nothing else to
// do (its first idle round): reading /proc/loadavg is a system call, and after a pause (a
// forward pass, a barrier) every sample is due, so sampling before the wait put that call, cold,
// in front of every first message.
#pragma once

#include <chrono>

namespace dicomm {

// One wait's polling phase: decides its budget and counts the thread as a poller meanwhile.
class PollPhase {
 public:
  PollPhase();
  ~PollPhase();
  PollPhase(const PollPhase&) = delete;
  PollPhase& operator=(const PollPhase&) = delete;
  // How long to poll before blocking: DICOMM_SPIN_US on a quiet host, zero on a busy one.
  std::chrono::microseconds budget() const { return budget_; }

 private:
  std::chrono::microseconds budget_{0};
};

// Whether the host had more runnable threads (other than this process's pollers) than cores, as
// of the last sample. No system call: a load of the last decision.
bool hostBusy();

// Samples /proc/loadavg if the last sample is a millisecond old or more (once per process per
// ms): by pollers with nothing else to do (`callerPolls`), never on a wait's way in (see above),
// and by waiters about to block.
void sampleHostLoad(bool callerPolls);

// One idle round of a poll loop: on the first round (0) it samples the host's load when due;
// then it pauses about 1 us in user space instead of calling sched_yield(): half the syscalls per
// round. Every 16th round still yields, so a waiter that shares its core with the rank it waits
// for lets that rank run.
void relax(unsigned round);

}  // namespace dicomm
