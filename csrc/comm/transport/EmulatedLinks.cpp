#include "comm/transport/EmulatedLinks.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace dicomm {

namespace {

// Ranges a link may have: from a modem's to beyond any scale-up fabric; up to 10 s one way.
constexpr double kMinGbps = 1e-6, kMaxGbps = 1e5, kMaxLatencyUs = 1e7;

// The state file: kSlots cache-line slots, each a link's name hash and when it is next free.
struct Slot {
  std::atomic<uint64_t> key;
  std::atomic<int64_t> freeAt;
  char pad[48];
};
static_assert(sizeof(Slot) == 64, "one link per cache line");
static_assert(std::atomic<int64_t>::is_always_lock_free, "the state is shared between processes");
constexpr size_t kSlots = 1024;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

double parseNumber(const std::string& text, const std::string& what) {
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || errno != 0 || !std::isfinite(v)) {
    throw std::invalid_argument(what + ": '" + text + "' is not a number");
  }
  return v;
}

std::vector<std::string> splitOn(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) out.push_back(item);
  if (!s.empty() && s.back() == sep) out.push_back("");
  return out;
}

double checkedGbps(const std::string& text, const std::string& what) {
  if (text.empty()) throw std::invalid_argument(what + " has no bandwidth; expected GB/s in [1e-06, 100000]");
  double gbps = parseNumber(text, what + " bandwidth");
  if (gbps < kMinGbps || gbps > kMaxGbps) {
    throw std::invalid_argument(what + " bandwidth " + text + " GB/s is out of range; expected GB/s in [1e-06, 100000]");
  }
  return gbps;
}

uint64_t hashName(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h ? h : 1;  // 0 marks a free slot
}

}  // namespace

int64_t steadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string LinkPlace::encode() const {
  std::ostringstream out;
  out.precision(17);
  out << dc << "/" << node << "/" << nicBytesPerSecond / 1e9;
  return out.str();
}

LinkPlace LinkPlace::parse(const std::string& text, const std::string& source) {
  auto fields = splitOn(text, '/');
  if (fields.size() < 2 || fields.size() > 3 || fields[0].empty() || fields[1].empty()) {
    throw std::invalid_argument(source + "='" + text + "' is invalid; expected DC/NODE or DC/NODE/NIC_GBPS");
  }
  LinkPlace place{fields[0], fields[1], 0};
  if (fields.size() == 3 && fields[2] != "0") {
    place.nicBytesPerSecond = checkedGbps(fields[2], source + "='" + text + "': the NIC") * 1e9;
  }
  return place;
}

LinkEmulation LinkEmulation::fromEnv(const std::string& defaultState) {
  LinkEmulation e;
  const std::string links = env("DICOMM_LINKS");
  if (links.empty()) return e;
  e.enabled = true;
  for (const std::string& entry : splitOn(links, ',')) {
    const std::string where = "DICOMM_LINKS='" + links + "': link '" + entry + "'";
    size_t eq = entry.find('=');
    if (eq == std::string::npos) {
      throw std::invalid_argument(where + " is not CLASS=GBPS:LATENCY_US");
    }
    std::string name = entry.substr(0, eq), value = entry.substr(eq + 1);
    if (name != "intra_node" && name != "inter_node" && name != "inter_cluster") {
      throw std::invalid_argument(where + ": unknown class '" + name +
                                  "'; expected intra_node, inter_node or inter_cluster");
    }
    if (e.classes.count(name)) throw std::invalid_argument(where + ": class '" + name + "' given twice");
    size_t colon = value.find(':');
    LinkClassSpec spec;
    spec.bytesPerSecond = checkedGbps(value.substr(0, colon), where) * 1e9;
    if (colon != std::string::npos) {
      std::string lat = value.substr(colon + 1);
      double us = parseNumber(lat, where + " latency");
      if (us < 0 || us > kMaxLatencyUs) {
        throw std::invalid_argument(where + " latency " + lat + " us is out of range; expected us in [0, 10000000]");
      }
      spec.latencySeconds = us * 1e-6;
    }
    e.classes[name] = spec;
  }
  const std::string place = env("DICOMM_LINK_PLACE");
  if (place.empty()) {
    throw std::invalid_argument("DICOMM_LINKS is set but DICOMM_LINK_PLACE is not; expected DC/NODE[/NIC_GBPS], "
                                "this rank's place in the fleet");
  }
  e.place = LinkPlace::parse(place, "DICOMM_LINK_PLACE");
  const std::string scale = env("DITORCH_TIME_SCALE");
  if (!scale.empty()) {
    e.timeScale = parseNumber(scale, "DITORCH_TIME_SCALE");
    if (e.timeScale < 1) {
      throw std::invalid_argument("DITORCH_TIME_SCALE='" + scale + "' is invalid; expected a number >= 1");
    }
  }
  e.statePath = env("DICOMM_LINK_STATE");
  if (e.statePath.empty()) e.statePath = defaultState;
  return e;
}

std::string LinkEmulation::classBetween(const LinkPlace& a, const LinkPlace& b) {
  if (a.dc != b.dc) return "inter_cluster";
  return a.node == b.node ? "intra_node" : "inter_node";
}

std::shared_ptr<LinkState> LinkState::open(const std::string& path) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<LinkState>> opened;
  std::lock_guard<std::mutex> lock(mu);
  if (auto known = opened[path].lock()) return known;
  const size_t bytes = kSlots * sizeof(Slot);
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw std::runtime_error("dicomm: cannot open the emulated links' state file DICOMM_LINK_STATE='" + path +
                             "': " + std::strerror(errno));
  }
  struct stat st {};
  // Every process grows the new file to the same size; a file already that size is left as is.
  if (fstat(fd, &st) != 0 || (static_cast<size_t>(st.st_size) < bytes && ftruncate(fd, bytes) != 0)) {
    int err = errno;
    ::close(fd);
    throw std::runtime_error("dicomm: cannot size the emulated links' state file '" + path + "': " +
                             std::strerror(err));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    throw std::runtime_error("dicomm: cannot map the emulated links' state file '" + path + "': " + std::strerror(err));
  }
  std::shared_ptr<LinkState> state(new LinkState(path, base, bytes));
  opened[path] = state;
  return state;
}

LinkState::LinkState(const std::string& path, void* base, size_t bytes) : path_(path), base_(base), bytes_(bytes) {}

LinkState::~LinkState() { munmap(base_, bytes_); }

std::atomic<int64_t>* LinkState::slot(const std::string& id) {
  Slot* slots = static_cast<Slot*>(base_);
  const uint64_t key = hashName(id);
  for (size_t i = 0; i < kSlots; ++i) {
    Slot& s = slots[(key + i) % kSlots];
    uint64_t seen = s.key.load(std::memory_order_acquire);
    if (seen == 0 && s.key.compare_exchange_strong(seen, key, std::memory_order_acq_rel)) return &s.freeAt;
    if (seen == key) return &s.freeAt;
  }
  throw std::runtime_error("dicomm: the emulated links' state file '" + path_ + "' has no room for link '" + id +
                           "' (" + std::to_string(kSlots) + " links)");
}

int64_t LinkState::reserve(std::atomic<int64_t>* link, int64_t durationNs, int64_t continueFrom) {
  const int64_t now = steadyNowNs();
  int64_t free = link->load(std::memory_order_acquire);
  while (true) {
    const int64_t start = (continueFrom >= 0 && free == continueFrom) ? continueFrom : std::max(now, free);
    if (link->compare_exchange_weak(free, start + durationNs, std::memory_order_acq_rel)) return start;
  }
}

}  // namespace dicomm
