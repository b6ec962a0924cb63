// Whether a pair is still up and, once it is not, why: failed (the cause every pending and later
// op on it gets) or closed locally. Both kinds of pair (StreamPair for tcp and shm, RdmaPair)
// keep one. The latch has no lock of its own: a pair changes it under the same lock as its
// queues, so that "down" and "nothing pending" are seen together.
#pragma once

#include <exception>
#include <string>

#include "comm/transport/Transport.h"

namespace dicomm {

class FailureLatch {
 public:
  FailureLatch(std::string transport, int peer) : transport_(std::move(transport)), peer_(peer) {}

  bool up() const { return !failed_ && !closing_; }
  bool failed() const { return failed_; }
  bool closing() const { return closing_; }

  // Latches failure `cause`; false, changing nothing, when the pair is already down.
  bool fail(const std::string& cause);
  // Latches the local close; false when it is already closing.
  bool close();

  // What an op on a pair that is down gets: the failure's cause, else "closed locally".
  std::exception_ptr error() const;
  // A TransportError for this pair's peer.
  std::exception_ptr error(const std::string& what) const;

  // The cause to report for a connection lost with `lost`: the peer's abort notice when it sent
  // one (a rank that aborts says why before it closes), else `lost`. `aborted` says which.
  std::string rootCause(Inbox& inbox, const std::string& lost, bool* aborted = nullptr) const;

 private:
  const std::string transport_;
  const int peer_;
  bool failed_ = false;
  bool closing_ = false;
  std::string cause_;
};

}  // namespace dicomm
