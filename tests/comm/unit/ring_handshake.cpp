// The small-frame ring's sleep/wake handshake (csrc/comm/transport/SmallFrameRing.h): a message
// the writer publishes is either seen by the reader's look after it went away, or announced by
// the writer (a bell, or the message itself on the socket when the reader was away before).
//
// `windows`: one process, both ends of one ring (the writer's end opened through /proc, as a
// peer opens it). Each round takes the reader away at one of three points: before publish(),
// inside it (between its two looks at the reader's state: the payload's page is protected, and
// the fault handler takes the reader away, looks at the ring, then lets the copy go on), and
// after it. A message neither seen nor announced is a lost wake-up. Thousands of rounds in
// milliseconds, each window hit on purpose instead of by luck.
//
// `stress`: two processes, as an shm pair: the reader polls for a random while, goes away, looks
// once more and then watches only the socket; the writer publishes while the reader is awake,
// rings the bell when publish() says so and sends on the socket when the reader was away. Each
// message waits for the reader's answer, so a lost wake-up stops both and the writer fails after
// a second. It runs until `messages` are through or 2 s have passed (a busy host slows each
// meeting of the two processes).
//
// Usage: ring_handshake windows <rounds> | ring_handshake stress <messages>.
// Prints "windows: ... no lost wake-up" / "stress: ... delivered", or what went wrong (exit 1).
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>

#include "comm/transport/SmallFrameRing.h"

using dicomm::SmallFrameRing;
using Put = SmallFrameRing::Put;

namespace {

using Clock = std::chrono::steady_clock;

// Takes every message in `ring` (the message number is the header's first word); returns how
// many, and stores the last number in `last`.
int drain(SmallFrameRing& ring, uint64_t* last) {
  int n = 0;
  bool corrupt = false;
  while (const char* slot = ring.peek(&corrupt)) {
    std::memcpy(last, slot, sizeof(*last));
    ring.consume();
    ++n;
  }
  if (corrupt) {
    std::printf("ring counts corrupt\n");
    std::exit(1);
  }
  return n;
}

// ---- windows ----------------------------------------------------------------------------------

SmallFrameRing* gReader;
void* gPage;
int gSeenInFault;
uint64_t gLast;

void takeReaderAway(int) {
  // Inside publish(): after its first look at the reader's state, before the slot is published.
  gReader->setAway();
  gSeenInFault = drain(*gReader, &gLast);
  ::mprotect(gPage, 4096, PROT_READ | PROT_WRITE);
}

int windows(long rounds) {
  std::string why;
  auto reader = SmallFrameRing::create(&why);
  auto writer = reader ? SmallFrameRing::openPeer(::getpid(), reader->fd(), &why) : nullptr;
  if (!writer) {
    std::printf("windows: cannot set up the ring: %s\n", why.c_str());
    return 1;
  }
  gReader = reader.get();
  gPage = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  struct sigaction sa {};
  sa.sa_handler = takeReaderAway;
  ::sigaction(SIGSEGV, &sa, nullptr);
  const char* where[] = {"before publish()", "inside publish()", "after publish()"};
  long announced = 0, seen = 0;
  char header[SmallFrameRing::kHeaderBytes] = {};
  for (long k = 0; k < rounds; ++k) {
    const int when = static_cast<int>(k % 3);
    reader->setAwake();
    uint64_t last = 0;
    int got = 0;
    if (when == 0) {
      reader->setAway();
      got = drain(*reader, &last);
    }
    gSeenInFault = 0;
    if (when == 1) ::mprotect(gPage, 4096, PROT_NONE);
    std::memcpy(header, &k, sizeof(k));
    const Put put = writer->publish(header, gPage, 256);
    if (when == 1) {
      ::mprotect(gPage, 4096, PROT_READ | PROT_WRITE);  // (the handler did, if the copy faulted)
      got += gSeenInFault;
      if (gSeenInFault) last = gLast;
    }
    if (when == 2) {
      reader->setAway();
      got += drain(*reader, &last);
    }
    // The reader sleeps now: the message must be behind it, or the writer must announce it.
    const bool published = put == Put::kPublished || put == Put::kPublishedWake;
    const bool told = put == Put::kPublishedWake || put == Put::kReaderAway;
    if (put == Put::kFull) {
      std::printf("windows: ring full in round %ld\n", k);
      return 1;
    }
    if (published && got == 0 && !told) {
      std::printf("lost wake-up: round %ld, the reader went away %s; the message stays in the ring "
                  "unannounced\n", k, where[when]);
      return 1;
    }
    if (put == Put::kPublishedWake && got == 0) got = drain(*reader, &last);  // the bell's look
    if (published && (got != 1 || last != static_cast<uint64_t>(k))) {
      std::printf("windows: round %ld (%s): %d messages taken, last %llu\n", k, where[when], got,
                  (unsigned long long)last);
      return 1;
    }
    seen += published && !told;
    announced += told;
  }
  std::printf("windows: %ld rounds, %ld seen by the reader's last look, %ld announced; no lost wake-up\n",
              rounds, seen, announced);
  return seen > 0 && announced > 0 ? 0 : 1;
}

// ---- stress -----------------------------------------------------------------------------------

constexpr uint64_t kBell = ~0ull;      // on the socket: "look at the ring"
constexpr uint64_t kStop = ~0ull - 1;  // on the socket: no more messages

bool sendWord(int fd, uint64_t w) { return ::write(fd, &w, sizeof(w)) == sizeof(w); }

// 1 with a word read, 0 if none came within `seconds` (polled, yielding the core: the run stays
// quick on a busy host), -1 on error or EOF.
int awaitWord(int fd, uint64_t* w, double seconds) {
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  while (true) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) return ::read(fd, w, sizeof(*w)) == sizeof(*w) ? 1 : -1;
    if (Clock::now() >= until) return 0;
    ::sched_yield();
  }
}

void spinFor(unsigned rounds) {
  for (unsigned i = 0; i < rounds; ++i) {
    if (i % 16 == 15) {
      ::sched_yield();  // meet the other process even when both share one core
      continue;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

int writer(pid_t readerPid, int ringFd, int sock, uint64_t messages) {
  std::string why;
  auto ring = SmallFrameRing::openPeer(readerPid, ringFd, &why);
  if (!ring) {
    std::printf("writer: cannot open the ring: %s\n", why.c_str());
    return 1;
  }
  std::mt19937 rng(7);
  char header[SmallFrameRing::kHeaderBytes] = {};
  uint64_t ringed = 0, belled = 0, socketed = 0, k = 0;
  const auto until = Clock::now() + std::chrono::seconds(2);
  for (; k < messages && Clock::now() < until; ++k) {
    spinFor(rng() % 400);  // land anywhere in the reader's cycle
    std::memcpy(header, &k, sizeof(k));
    switch (ring->publish(header, &k, sizeof(k))) {
      case Put::kPublished: ++ringed; break;
      case Put::kPublishedWake: ++belled; if (!sendWord(sock, kBell)) return 1; break;
      default: ++socketed; if (!sendWord(sock, k)) return 1; break;
    }
    uint64_t ack = 0;
    const int got = awaitWord(sock, &ack, 1.0);
    if (got == 0) {
      std::printf("lost wake-up: message %llu was not answered within 1 s\n", (unsigned long long)k);
      std::fflush(stdout);
      return 1;
    }
    if (got < 0 || ack != k) return 1;
  }
  sendWord(sock, kStop);
  std::printf("stress: %llu messages delivered (%llu through the ring, %llu with a bell, %llu on the socket)\n",
              (unsigned long long)k, (unsigned long long)ringed, (unsigned long long)belled,
              (unsigned long long)socketed);
  std::fflush(stdout);
  return ringed > 0 && socketed > 0 ? 0 : 1;
}

int reader(SmallFrameRing& ring, int sock) {
  std::mt19937 rng(11);
  uint64_t next = 0;
  auto take = [&](uint64_t k) {
    if (k != next) {
      std::printf("reader: message %llu where %llu was due\n", (unsigned long long)k, (unsigned long long)next);
      std::exit(1);
    }
    ++next;
    if (!sendWord(sock, k)) std::exit(1);
  };
  auto look = [&] {
    uint64_t k;
    bool corrupt = false;
    while (const char* slot = ring.peek(&corrupt)) {
      std::memcpy(&k, slot, sizeof(k));
      ring.consume();
      take(k);
    }
  };
  while (true) {
    ring.setAwake();
    const unsigned rounds = rng() % 800;
    for (unsigned i = 0; i < rounds; ++i) {
      look();
      spinFor(i % 8 == 7 ? 16 : 1);
    }
    spinFor(rng() % 100);  // between its last look and going away, as a poller finishing its op
    ring.setAway();
    look();  // the look after going away: without it a message published meanwhile is lost
    uint64_t w;
    if (awaitWord(sock, &w, 5.0) <= 0) return 1;  // the writer reports the lost wake-up
    if (w == kStop) return 0;
    if (w == kBell) {
      look();
    } else {
      take(w);
    }
  }
}

int stress(uint64_t messages) {
  std::string why;
  auto ring = SmallFrameRing::create(&why);
  int sv[2];
  if (!ring || ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    std::printf("stress: cannot set up: %s\n", why.c_str());
    return 1;
  }
  const pid_t parent = ::getpid();
  const int ringFd = ring->fd();
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(sv[0]);
    std::_Exit(writer(parent, ringFd, sv[1], messages));
  }
  ::close(sv[1]);
  const int mine = reader(*ring, sv[0]);
  if (mine != 0) ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  return mine == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const long count = argc > 2 ? std::strtol(argv[2], nullptr, 10) : 3000;
  if (mode == "windows") return windows(count);
  if (mode == "stress") return stress(static_cast<uint64_t>(count));
  std::printf("usage: ring_handshake windows|stress <count>\n");
  return 2;
}
