// Coverage-guided fuzzer (libFuzzer) of what an authenticated peer can send a stream pair: the
// frame parser of the tcp/shm transports (StreamPair) and the core's matching (Mailbox) behind
// it, both real. Each input is one connection's life: a few receives are posted (or not), the
// input's bytes arrive on the pair's main lane and one data lane, then the peer closes. Whatever
// the bytes, the pair must end with exactly one failure report naming the peer, every posted
// receive must complete, and nothing may crash, leak or trip a sanitizer.
//
// Input: byte 0 picks the receives posted before the bytes arrive (bit 0: a 16-byte float
// receive on p2p tag 5; bit 1: a 2 MiB one on tag 6; bit 2: any-source on tag 5), byte 1 how
// many of the remaining bytes go to the main lane (in 1/255ths), the rest to the data lane.
// Built and run by `make test-asan` (tests/comm/fuzz/run.sh).
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "comm/core/Mailbox.h"
#include "comm/core/Tags.h"
#include "comm/transport/StreamPair.h"

namespace {

using namespace dicomm;

constexpr int kPeer = 0;

// Writes what fits now; a pair that failed stops reading, so never block on it.
void offer(int fd, const uint8_t* data, size_t n) {
  while (n > 0) {
    const ssize_t k = ::send(fd, data, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (k <= 0) return;
    data += k;
    n -= static_cast<size_t>(k);
  }
}

// The real matching, counting how the pair reports its end (a failure or a clean close).
class WatchedMailbox : public Mailbox {
 public:
  WatchedMailbox() : Mailbox(1) {}
  void peerFailed(int peer, const std::string& cause) override {
    ended(peer, cause);
    Mailbox::peerFailed(peer, cause);
  }
  void peerClosed(int peer, const std::string& cause) override {
    ended(peer, cause);
    Mailbox::peerClosed(peer, cause);
  }
  // Waits for the report; aborts (a defect) if it does not come or does not name the peer.
  void expectOneEnd() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::seconds(20), [&] { return ends_ > 0; })) {
      std::fprintf(stderr, "fuzz: the pair did not report the closed connection within 20 s\n");
      std::abort();
    }
    if (cause_.find("rank 0") == std::string::npos) {
      std::fprintf(stderr, "fuzz: a failure that does not name the peer: %s\n", cause_.c_str());
      std::abort();
    }
  }
  int ends() {
    std::lock_guard<std::mutex> lock(mu_);
    return ends_;
  }

 private:
  void ended(int peer, const std::string& cause) {
    if (peer != kPeer) std::abort();
    std::lock_guard<std::mutex> lock(mu_);
    ++ends_;
    cause_ = cause;
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  int ends_ = 0;
  std::string cause_;
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Sizes above this are refused before allocating (tests/comm/test_hostile_frames.py covers
  // the default); here it keeps every allocation under libFuzzer's malloc limit.
  ::setenv("DICOMM_MAX_MESSAGE_BYTES", "16777216", 1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t posts = data[0];
  const size_t body = size - 2;
  const size_t mainBytes = body * data[1] / 255;

  int mainFds[2], laneFds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, mainFds) ||
      ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, laneFds)) {
    std::abort();
  }
  Fd ourMain(mainFds[0]), ourLane(laneFds[0]);
  std::vector<Fd> theirs;
  theirs.emplace_back(mainFds[1]);
  theirs.emplace_back(laneFds[1]);

  WatchedMailbox mailbox;
  std::vector<std::shared_ptr<Completion>> receives;
  std::vector<std::vector<char>> buffers;
  auto post = [&](int peer, uint64_t tag, size_t nbytes) {
    buffers.emplace_back(nbytes);
    RecvRequest r;
    r.peer = peer;
    r.tag = tag;
    r.data = buffers.back().data();
    r.nbytes = nbytes;
    r.dtype = 6;  // Float
    r.completion = std::make_shared<Completion>();
    receives.push_back(r.completion);
    mailbox.post(std::move(r));
  };
  buffers.reserve(3);
  if (posts & 1) post(kPeer, p2pTag(5), 16);
  if (posts & 2) post(kPeer, p2pTag(6), 2 << 20);
  if (posts & 4) post(-1, p2pTag(5), 16);

  StreamConfig config;
  config.name = "fuzz";
  config.tcp = false;
  config.lanes = 2;
  {
    auto pair = StreamPair::start(kPeer, std::move(theirs), &mailbox, config, ::getpid(),
                                  /*remoteOk=*/false);
    offer(ourMain.get(), data + 2, mainBytes);
    offer(ourLane.get(), data + 2 + mainBytes, body - mainBytes);
    ::shutdown(ourMain.get(), SHUT_WR);
    ::shutdown(ourLane.get(), SHUT_WR);
    mailbox.expectOneEnd();
    pair->close();  // joins its threads: nothing of this input runs on into the next
  }
  mailbox.failAll(std::make_exception_ptr(std::runtime_error("fuzz: pair closed")));
  for (auto& r : receives) {
    if (!r->done()) std::abort();  // a receive left pending forever
  }
  if (mailbox.ends() < 1) std::abort();  // (an abort notice reports once more, by the core)
  return 0;
}
