// Unit checks of the transport's bookkeeping objects, with no sockets: the failure latch both
// pair kinds keep, the receiving side's book of rendezvous transfers, the listener's bound on
// the connections it greets at once, and the mailbox's receives around a failure. Built and run by
// tests/comm/test_transport_units.py; prints one line per failed check, exits non-zero if any.
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/core/Mailbox.h"
#include "comm/transport/FailureLatch.h"
#include "comm/transport/GreetingBound.h"
#include "comm/transport/RendezvousBook.h"

namespace {

int failures = 0;

#define EXPECT(cond)                                                     \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);       \
      ++failures;                                                       \
    }                                                                   \
  } while (0)

std::string message(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const dicomm::TransportError& t) {
    return std::to_string(t.peer()) + "|" + t.what();
  } catch (...) {
    return "not a TransportError";
  }
}

struct NoticeInbox : dicomm::Inbox {
  std::string notice;
  dicomm::Landing arrive(int, const dicomm::Envelope&) override { return {}; }
  void peerFailed(int, const std::string&) override {}
  std::string abortNotice(int) override { return notice; }
};

void latchIsUpUntilFailedOrClosed() {
  dicomm::FailureLatch latch("tcp", 3);
  EXPECT(latch.up());
  EXPECT(latch.fail("tcp: connection reset"));
  EXPECT(!latch.up() && latch.failed() && !latch.closing());
  EXPECT(!latch.fail("a later, lesser cause"));  // the first cause stays
  EXPECT(message(latch.error()) == "3|tcp: connection reset");
  EXPECT(latch.close());   // closing a failed pair still happens once
  EXPECT(!latch.close());
  EXPECT(message(latch.error()) == "3|tcp: connection reset");
}

void closedLatchRefusesFailure() {
  dicomm::FailureLatch latch("rdma", 1);
  EXPECT(latch.close());
  EXPECT(!latch.fail("late"));
  EXPECT(!latch.failed() && latch.closing());
  EXPECT(message(latch.error()) == "1|rdma: pair to rank 1 closed locally");
}

void rootCausePrefersTheAbortNotice() {
  dicomm::FailureLatch latch("shm", 2);
  NoticeInbox inbox;
  bool aborted = true;
  EXPECT(latch.rootCause(inbox, "EOF", &aborted) == "EOF" && !aborted);
  inbox.notice = "rank 2 aborted: rank 5 died";
  EXPECT(latch.rootCause(inbox, "EOF", &aborted) == inbox.notice && aborted);
}

dicomm::Landing landingInto(std::vector<char>& buffer, int* completions) {
  dicomm::Landing l;
  l.data = buffer.data();
  l.capacity = buffer.size();
  l.done = [completions](std::exception_ptr) { ++*completions; };
  return l;
}

bool throwsInvalid(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument&) {
    return true;
  }
  return false;
}

void bookLandsPartsInPlaceOnce() {
  constexpr size_t P = dicomm::RendezvousBook::kPartAlign;
  dicomm::RendezvousBook book;
  std::vector<char> buffer(3 * P);
  int completions = 0;
  dicomm::Landing l = landingInto(buffer, &completions);
  EXPECT(book.expect(7, l, 3 * P));
  dicomm::Landing again = landingInto(buffer, &completions);
  EXPECT(!book.expect(7, again, 3 * P));  // announced twice: the caller keeps its landing
  EXPECT(again.done != nullptr);
  EXPECT(book.claimPart(7, P, 2 * P) == buffer.data() + P);
  EXPECT(throwsInvalid([&] { book.claimPart(7, 2 * P, P + 1); }));  // past the end
  EXPECT(throwsInvalid([&] { book.claimPart(7, 4 * P, 0); }));
  EXPECT(throwsInvalid([&] { book.claimPart(8, 0, 1); }));          // never asked for
  EXPECT(throwsInvalid([&] { book.claimPart(7, 1, 10); }));         // off a page boundary
  EXPECT(throwsInvalid([&] { book.claimPart(7, 2 * P, P); }));      // overlaps the first part
  EXPECT(throwsInvalid([&] { book.claimPart(7, 0, P + 1); }));      // overlaps it too
  dicomm::Landing done;
  EXPECT(!book.partLanded(7, 2 * P, &done));
  EXPECT(throwsInvalid([&] { book.takeWhole(7, 3 * P); }));         // whole after parts
  EXPECT(book.claimPart(7, 0, P) == buffer.data());
  EXPECT(book.partLanded(7, P, &done) && done.data == buffer.data());
  EXPECT(!book.pending(7));
  EXPECT(!book.partLanded(7, 1, &done));  // completed already (or failed meanwhile)
}

void bookDropsIntoNothingAndHandsBackTheRest() {
  dicomm::RendezvousBook book;
  int completions = 0;
  dicomm::Landing dropped;  // the core refused the message: bytes are read and discarded
  EXPECT(book.expect(1, dropped, 10));
  EXPECT(book.claimPart(1, 0, 10) == nullptr);
  std::vector<char> small(4);
  dicomm::Landing tooSmall = landingInto(small, &completions);
  EXPECT(book.expect(2, tooSmall, 10));
  EXPECT(book.claimPart(2, 0, 4) == nullptr);
  EXPECT(throwsInvalid([&] { book.takeWhole(2, 9); }));
  EXPECT(book.takeWhole(2, 10).data == small.data());
  std::vector<dicomm::Landing> left = book.takeAll();
  EXPECT(left.size() == 1 && !book.pending(1));
}

}  // namespace

void greetingBoundFallsWhenOutOfDescriptorsAndReturnsWithRoom() {
  const size_t group = 64 + 2 * 13 * 2;  // 13 ranks, 2 lanes
  dicomm::GreetingBound bound;
  EXPECT(!bound.lowered() && bound.limit(group) == group);
  bound.accepted(group, 0);  // not lowered: an accept changes nothing
  EXPECT(bound.limit(group) == group);
  bound.exhausted(40);  // EMFILE with 40 held: half of them
  EXPECT(bound.lowered() && bound.limit(group) == 20);
  bound.exhausted(3);  // never below the floor
  EXPECT(bound.limit(group) == dicomm::GreetingBound::kFloor);
  bound.accepted(group, 30);  // some room: half of it
  EXPECT(bound.limit(group) == 15);
  bound.accepted(group, 10);  // less room later: it does not fall on an accept
  EXPECT(bound.limit(group) == 15);
  bound.accepted(group, group - 1);
  EXPECT(bound.lowered() && bound.limit(group) == (group - 1) / 2);
  bound.accepted(group, group);  // room for the whole group's bound: the group's again
  EXPECT(!bound.lowered() && bound.limit(group) == group);
  EXPECT(bound.limit(8) == 8);
}

// A receive posted once the communicator failed completes at once with the failure: the
// communicator's closed check and its failAll are not atomic with a post, so a receive can
// reach the mailbox after failAll and would otherwise wait in it until its timeout.
void receivesPostedAfterAFailureFailAtOnce() {
  dicomm::Mailbox mailbox(1);
  auto before = std::make_shared<dicomm::Completion>();
  dicomm::RecvRequest r;
  r.peer = 0;
  r.tag = 5;
  r.completion = before;
  mailbox.post(r);
  EXPECT(!before->done());
  mailbox.failAll(std::make_exception_ptr(dicomm::TransportError(0, "rank 0 went away")));
  EXPECT(before->done() && message(before->error()) == "0|rank 0 went away");
  for (int peer : {0, -1}) {  // from a rank, and from any source
    auto after = std::make_shared<dicomm::Completion>();
    r.peer = peer;
    r.completion = after;
    mailbox.post(r);
    EXPECT(after->done() && message(after->error()) == "0|rank 0 went away");
  }
}

int main() {
  latchIsUpUntilFailedOrClosed();
  closedLatchRefusesFailure();
  rootCausePrefersTheAbortNotice();
  bookLandsPartsInPlaceOnce();
  bookDropsIntoNothingAndHandsBackTheRest();
  greetingBoundFallsWhenOutOfDescriptorsAndReturnsWithRoom();
  receivesPostedAfterAFailureFailAtOnce();
  if (failures == 0) std::printf("transport units: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
