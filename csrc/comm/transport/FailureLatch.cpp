#include "comm/transport/FailureLatch.h"

namespace dicomm {

bool FailureLatch::fail(const std::string& cause) {
  if (!up()) return false;
  failed_ = true;
  cause_ = cause;
  return true;
}

bool FailureLatch::close() {
  if (closing_) return false;
  closing_ = true;
  return true;
}

std::exception_ptr FailureLatch::error() const {
  return error(failed_ ? cause_
                       : transport_ + ": pair to rank " + std::to_string(peer_) + " closed locally");
}

std::exception_ptr FailureLatch::error(const std::string& what) const {
  return std::make_exception_ptr(TransportError(peer_, what));
}

std::string FailureLatch::rootCause(Inbox& inbox, const std::string& lost, bool* aborted) const {
  std::string notice = inbox.abortNotice(peer_);
  if (aborted) *aborted = !notice.empty();
  return notice.empty() ? lost : notice;
}

}  // namespace dicomm
