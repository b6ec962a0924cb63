// Transport-level check and micro-benchmark for DiComm transports (rdma, and tcp as the
// control), independent of the backend: N processes connect through a c10d TCPStore and
// exchange messages through `Transport`/`Pair` directly, with an Inbox that matches by tag.
//
//   transport_check <transport> <rank> <size> <store port> <mode>
//   modes: sizes   1 B .. 64 MiB into posted buffers (torch CPU tensors), data checked
//          many    1000 outstanding mixed-size messages per peer into unexpected buffers,
//                  arrival order and data checked
//          reuse   tensors freed and reallocated at the same address between sends (a stale
//                  registration would move the old pages), data checked
//          die     the last rank exits abruptly; every other rank's pending receive and a
//                  later send must fail naming that rank, within 20 s
//          bench   ping-pong latency and one-way bandwidth, rank 0 <-> 1, printed as
//                  "bench <bytes> <one-way us> <GB/s>"
//          oracle  rank 0 only, with rank 1 the independent pyverbs peer verbs_oracle.py:
//                  1000 B (eager) and 1 MiB (rendezvous) each way, data checked here and there
// Exit code 0 means every check passed; failures print "FAIL: ..." to stderr.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "comm/transport/Transport.h"

using namespace dicomm;
using Clock = std::chrono::steady_clock;

namespace {

int gRank = 0;
int gFailures = 0;
#define EXPECT(cond, ...)                                              \
  do {                                                                 \
    if (!(cond)) {                                                     \
      fprintf(stderr, "FAIL rank %d: ", gRank);                        \
      fprintf(stderr, __VA_ARGS__);                                    \
      fprintf(stderr, "\n");                                           \
      ++gFailures;                                                     \
    }                                                                  \
  } while (0)

uint8_t pattern(int src, int dst, uint64_t tag, size_t i) {
  return static_cast<uint8_t>(src * 131 + dst * 31 + tag * 7 + (i * 13) + (i >> 11));
}

void fill(uint8_t* p, size_t n, int src, int dst, uint64_t tag) {
  for (size_t i = 0; i < n; ++i) p[i] = pattern(src, dst, tag, i);
}

bool verify(const uint8_t* p, size_t n, int src, int dst, uint64_t tag, size_t* bad) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != pattern(src, dst, tag, i)) {
      *bad = i;
      return false;
    }
  }
  return true;
}

// Matches arrivals to posted buffers by (peer, tag); unposted ones land in fresh vectors.
class TestInbox : public Inbox {
 public:
  struct Slot {
    void* posted = nullptr;
    size_t capacity = 0;
    std::vector<uint8_t> unexpected;
    bool arrived = false, done = false;
    uint64_t nbytes = 0;
    std::string error;
  };

  void post(int peer, uint64_t tag, void* buf, size_t cap) {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& s = slots_[{peer, tag}];
    s.posted = buf;
    s.capacity = cap;
  }

  Landing arrive(int peer, const Envelope& env) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto& last = lastTag_[peer];
    if (env.tag < last) orderErrors_.push_back("tag " + std::to_string(env.tag) + " after " + std::to_string(last) + " from rank " + std::to_string(peer));
    last = env.tag;
    Slot& s = slots_[{peer, env.tag}];
    s.arrived = true;
    s.nbytes = env.nbytes;
    Landing l;
    if (s.posted) {
      if (s.capacity >= env.nbytes) {
        l.data = s.posted;
        l.capacity = s.capacity;
      }
    } else {
      s.unexpected.resize(env.nbytes);
      l.data = s.unexpected.data();
      l.capacity = env.nbytes;
    }
    l.done = [this, peer, tag = env.tag](std::exception_ptr e) {
      std::lock_guard<std::mutex> lock(mu_);
      Slot& s = slots_[{peer, tag}];
      s.done = true;
      if (e) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& ex) {
          s.error = ex.what();
        }
      }
      cv_.notify_all();
    };
    return l;
  }

  void peerFailed(int peer, const std::string& cause) override {
    std::lock_guard<std::mutex> lock(mu_);
    failed_[peer] = cause;
    cv_.notify_all();
  }

  // Waits for (peer, tag); returns "" or the error (peer failure / landing error / timeout).
  std::string wait(int peer, uint64_t tag, double seconds, Slot* out = nullptr) {
    std::unique_lock<std::mutex> lock(mu_);
    auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    while (true) {
      Slot& s = slots_[{peer, tag}];
      if (s.done) {
        std::string err = s.error;
        if (out) *out = std::move(s);
        slots_.erase({peer, tag});
        return err;
      }
      auto f = failed_.find(peer);
      if (f != failed_.end()) return "peer failed: " + f->second;
      if (cv_.wait_until(lock, until) == std::cv_status::timeout) return "timeout";
    }
  }

  std::vector<std::string> orderErrors() {
    std::lock_guard<std::mutex> lock(mu_);
    return orderErrors_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<int, uint64_t>, Slot> slots_;
  std::map<int, uint64_t> lastTag_;
  std::map<int, std::string> failed_;
  std::vector<std::string> orderErrors_;
};

// Counts send completions; remembers errors.
struct SendTracker {
  std::mutex mu;
  std::condition_variable cv;
  int pending = 0;
  std::vector<std::string> errors;
  SendDone make() {
    std::lock_guard<std::mutex> lock(mu);
    ++pending;
    return [this](std::exception_ptr e) {
      std::lock_guard<std::mutex> lock(mu);
      --pending;
      if (e) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& ex) {
          errors.push_back(ex.what());
        }
      }
      cv.notify_all();
    };
  }
  bool waitAll(double seconds) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return pending == 0; });
  }
};

void barrier(c10d::Store& store, const std::string& name, int size) {
  store.add("barrier/" + name, 1);
  auto until = Clock::now() + std::chrono::seconds(300);
  while (store.add("barrier/" + name, 0) < size) {
    if (Clock::now() > until) throw std::runtime_error("barrier " + name + " timed out");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

Envelope envelope(uint64_t tag, size_t n) {
  Envelope e;
  e.tag = tag;
  e.nbytes = n;
  e.dtype = 0;  // uint8
  return e;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: transport_check <transport> <rank> <size> <store port> <sizes|many|reuse|die|bench|oracle>\n");
    return 2;
  }
  const std::string transportName = argv[1];
  const int rank = gRank = atoi(argv[2]);
  const int size = atoi(argv[3]);
  const int port = atoi(argv[4]);
  const std::string mode = argv[5];

  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = rank == 0;
  opts.numWorkers = size;
  opts.timeout = std::chrono::seconds(120);
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);

  auto& registry = transportRegistry();
  auto it = registry.find(transportName);
  if (it == registry.end()) {
    fprintf(stderr, "transport %s is not built in\n", transportName.c_str());
    return 3;
  }
  if (!it->second.usable()) {
    fprintf(stderr, "transport %s is not usable here\n", transportName.c_str());
    return 4;
  }
  TestInbox inbox;
  TransportContext ctx;
  ctx.store = store;
  ctx.keyPrefix = "check/";
  ctx.rank = rank;
  ctx.size = size;
  ctx.timeout = std::chrono::seconds(60);
  ctx.inbox = &inbox;
  ctx.authKey = std::vector<uint8_t>(32, 7);
  auto transport = it->second.create();
  transport->start(ctx);
  std::map<int, std::shared_ptr<Pair>> pairs;
  for (int p = 0; p < size; ++p) {
    if (p != rank) pairs[p] = transport->connect(p);
  }
  barrier(*store, "connected", size);
  auto t0 = Clock::now();

  if (mode == "sizes") {
    const std::vector<size_t> sizes = {1, 7, 64, 4096, 32768, 32769, 65536, 1 << 20, 64 << 20};
    std::map<std::pair<int, uint64_t>, at::Tensor> recvBufs;
    for (auto& kv : pairs) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        at::Tensor t = at::zeros({static_cast<int64_t>(sizes[i])}, at::kByte);
        inbox.post(kv.first, i + 1, t.data_ptr(), sizes[i]);
        recvBufs[{kv.first, i + 1}] = t;
      }
    }
    barrier(*store, "posted", size);
    SendTracker sends;
    std::vector<at::Tensor> sendBufs;
    for (auto& kv : pairs) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        at::Tensor t = at::empty({static_cast<int64_t>(sizes[i])}, at::kByte);
        fill(t.data_ptr<uint8_t>(), sizes[i], rank, kv.first, i + 1);
        sendBufs.push_back(t);
        kv.second->send(envelope(i + 1, sizes[i]), t.data_ptr(), MemoryKind::kHost, sends.make());
      }
    }
    for (auto& kv : recvBufs) {
      std::string err = inbox.wait(kv.first.first, kv.first.second, 120);
      EXPECT(err.empty(), "receive of %zu bytes from rank %d: %s", sizes[kv.first.second - 1], kv.first.first, err.c_str());
      size_t bad = 0;
      EXPECT(err.empty() && verify(kv.second.data_ptr<uint8_t>(), kv.second.numel(), kv.first.first, rank, kv.first.second, &bad),
            "%lld bytes from rank %d differ at byte %zu", (long long)kv.second.numel(), kv.first.first, bad);
    }
    EXPECT(sends.waitAll(120), "sends did not complete");
    EXPECT(sends.errors.empty(), "send error: %s", sends.errors.empty() ? "" : sends.errors[0].c_str());
  } else if (mode == "oracle") {
    // The peer is tests/comm_rdma/verbs_oracle.py; its tags and sizes are these.
    if (rank != 0 || size != 2) {
      fprintf(stderr, "oracle mode runs as rank 0 of 2 (rank 1 is verbs_oracle.py)\n");
      return 2;
    }
    const size_t eagerN = 1000, largeN = 1 << 20;
    at::Tensor in1 = at::zeros({static_cast<int64_t>(eagerN)}, at::kByte);
    at::Tensor in2 = at::zeros({static_cast<int64_t>(largeN)}, at::kByte);
    inbox.post(1, 1, in1.data_ptr(), eagerN);
    inbox.post(1, 2, in2.data_ptr(), largeN);
    barrier(*store, "posted", size);
    SendTracker sends;
    at::Tensor out3 = at::empty({static_cast<int64_t>(eagerN)}, at::kByte);
    at::Tensor out4 = at::empty({static_cast<int64_t>(largeN)}, at::kByte);
    fill(out3.data_ptr<uint8_t>(), eagerN, 0, 1, 3);
    fill(out4.data_ptr<uint8_t>(), largeN, 0, 1, 4);
    pairs[1]->send(envelope(3, eagerN), out3.data_ptr(), MemoryKind::kHost, sends.make());
    pairs[1]->send(envelope(4, largeN), out4.data_ptr(), MemoryKind::kHost, sends.make());
    for (uint64_t tag : {1, 2}) {
      at::Tensor& t = tag == 1 ? in1 : in2;
      std::string err = inbox.wait(1, tag, 60);
      EXPECT(err.empty(), "receive of tag %llu from the oracle: %s", (unsigned long long)tag, err.c_str());
      size_t bad = 0;
      EXPECT(err.empty() && verify(t.data_ptr<uint8_t>(), t.numel(), 1, 0, tag, &bad),
             "tag %llu from the oracle differs at byte %zu", (unsigned long long)tag, bad);
    }
    EXPECT(sends.waitAll(60), "sends to the oracle did not complete");
    EXPECT(sends.errors.empty(), "send error: %s", sends.errors.empty() ? "" : sends.errors[0].c_str());
    // The oracle's last check (an RDMA READ that must be refused) breaks the pair: after this
    // barrier nothing is checked here, and in2 (the buffer it probes) stays registered.
    barrier(*store, "verified", size);
  } else if (mode == "many") {
    const std::vector<size_t> sizes = {1, 100, 4000, 32768, 40000, 300000};
    const int count = 1000;
    std::vector<std::vector<uint8_t>> data;  // kept alive until the sends complete
    SendTracker sends;
    for (int m = 0; m < count; ++m) {
      for (auto& kv : pairs) {
        size_t n = sizes[(m + kv.first) % sizes.size()];
        data.emplace_back(n);
        fill(data.back().data(), n, rank, kv.first, m + 1);
        kv.second->send(envelope(m + 1, n), data.back().data(), MemoryKind::kHost, sends.make());
      }
    }
    for (int m = 0; m < count; ++m) {
      for (auto& kv : pairs) {
        TestInbox::Slot s;
        std::string err = inbox.wait(kv.first, m + 1, 120, &s);
        EXPECT(err.empty(), "message %d from rank %d: %s", m + 1, kv.first, err.c_str());
        size_t bad = 0, n = sizes[(m + rank) % sizes.size()];
        EXPECT(err.empty() && s.unexpected.size() == n && verify(s.unexpected.data(), n, kv.first, rank, m + 1, &bad),
              "message %d from rank %d: %zu bytes (want %zu), bad byte %zu", m + 1, kv.first, s.unexpected.size(), n, bad);
      }
    }
    EXPECT(sends.waitAll(120), "sends did not complete");
    EXPECT(sends.errors.empty(), "send error: %s", sends.errors.empty() ? "" : sends.errors[0].c_str());
    for (auto& e : inbox.orderErrors()) EXPECT(false, "out of order: %s", e.c_str());
  } else if (mode == "reuse") {
    const size_t n = 4 << 20;
    std::set<void*> sendAddrs, recvAddrs;
    for (int round = 1; round <= 6; ++round) {
      std::map<int, at::Tensor> recvBufs;
      for (auto& kv : pairs) {
        recvBufs[kv.first] = at::zeros({static_cast<int64_t>(n)}, at::kByte);
        recvAddrs.insert(recvBufs[kv.first].data_ptr());
        inbox.post(kv.first, round, recvBufs[kv.first].data_ptr(), n);
      }
      barrier(*store, "reuse-posted-" + std::to_string(round), size);
      SendTracker sends;
      {
        std::vector<at::Tensor> bufs;
        for (auto& kv : pairs) {
          at::Tensor t = at::empty({static_cast<int64_t>(n)}, at::kByte);
          sendAddrs.insert(t.data_ptr());
          fill(t.data_ptr<uint8_t>(), n, rank, kv.first, round);
          bufs.push_back(t);
          kv.second->send(envelope(round, n), t.data_ptr(), MemoryKind::kHost, sends.make());
        }
        EXPECT(sends.waitAll(120), "round %d: sends did not complete", round);
      }  // send tensors freed here; the next round's allocations usually reuse the addresses
      for (auto& kv : recvBufs) {
        std::string err = inbox.wait(kv.first, round, 120);
        size_t bad = 0;
        EXPECT(err.empty() && verify(kv.second.data_ptr<uint8_t>(), n, kv.first, rank, round, &bad),
              "round %d from rank %d: %s, bad byte %zu", round, kv.first, err.c_str(), bad);
      }
      barrier(*store, "reuse-done-" + std::to_string(round), size);
    }
    printf("reuse: %zu distinct send addresses, %zu distinct receive addresses over 6 rounds\n",
           sendAddrs.size(), recvAddrs.size());
  } else if (mode == "die") {
    const int victim = size - 1;
    if (rank == victim) {
      fflush(stdout);
      _exit(0);  // no goodbye, no close: as if killed
    }
    auto start = Clock::now();
    TestInbox::Slot s;
    std::string err = inbox.wait(victim, 99, 30, &s);
    double took = std::chrono::duration<double>(Clock::now() - start).count();
    EXPECT(err.find("peer failed") == 0 && err.find("rank " + std::to_string(victim)) != std::string::npos,
          "pending receive from the dead rank ended with '%s'", err.c_str());
    EXPECT(took < 20, "noticing the dead rank took %.1f s", took);
    SendTracker sends;
    uint8_t byte = 1;
    pairs[victim]->send(envelope(100, 1), &byte, MemoryKind::kHost, sends.make());
    EXPECT(sends.waitAll(20), "send to the dead rank never completed");
    EXPECT(sends.errors.size() == 1 && sends.errors[0].find("rank " + std::to_string(victim)) != std::string::npos,
          "send to the dead rank: %s", sends.errors.empty() ? "no error" : sends.errors[0].c_str());
    printf("die: rank %d noticed in %.2f s: %s\n", rank, took, err.c_str());
  } else if (mode == "bench") {
    if (rank <= 1) {
      const int peer = 1 - rank;
      uint64_t tag = 1;
      for (size_t n : std::vector<size_t>{8, 4096, 65536, 1 << 20, 16 << 20, 64 << 20}) {
        at::Tensor buf = at::empty({static_cast<int64_t>(n)}, at::kByte);
        at::Tensor in = at::empty({static_cast<int64_t>(n)}, at::kByte);
        buf.fill_(1);
        const int iters = n <= 65536 ? 200 : n <= (1 << 20) ? 20 : 3;
        std::vector<double> rtts;
        for (int i = 0; i < iters + 1; ++i) {
          SendTracker sends;
          auto s0 = Clock::now();
          if (rank == 0) {
            inbox.post(peer, tag + 1, in.data_ptr(), n);
            pairs[peer]->send(envelope(tag, n), buf.data_ptr(), MemoryKind::kHost, sends.make());
            EXPECT(inbox.wait(peer, tag + 1, 120).empty(), "bench pong %zu", n);
          } else {
            inbox.post(peer, tag, in.data_ptr(), n);
            EXPECT(inbox.wait(peer, tag, 120).empty(), "bench ping %zu", n);
            pairs[peer]->send(envelope(tag + 1, n), buf.data_ptr(), MemoryKind::kHost, sends.make());
          }
          sends.waitAll(120);
          tag += 2;
          if (i > 0) rtts.push_back(std::chrono::duration<double>(Clock::now() - s0).count());
        }
        std::sort(rtts.begin(), rtts.end());
        double oneWay = rtts[rtts.size() / 2] / 2;
        if (rank == 0) printf("bench %zu %.1f %.3f\n", n, oneWay * 1e6, n / oneWay / 1e9);
        fflush(stdout);
      }
    }
  } else {
    fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  }
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  if (mode != "die") barrier(*store, "finished", size);
  for (auto& kv : pairs) kv.second->close();
  pairs.clear();
  printf("rank %d %s %s: %s in %.2f s\n", rank, transportName.c_str(), mode.c_str(),
         gFailures ? "FAILED" : "ok", secs);
  fflush(stdout);
  _exit(gFailures ? 1 : 0);  // skip static destructors: the store server may be gone already
}
