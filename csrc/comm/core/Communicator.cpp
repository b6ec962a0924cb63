#include "comm/core/Communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/core/Tags.h"
#include "comm/transport/Log.h"
#include "comm/transport/PacedPair.h"
#include "comm/transport/Spin.h"
#include "comm/transport/Trace.h"

namespace dicomm {

namespace {

constexpr const char* kStorePrefix = "dicomm/";  // the group's keys in the store

std::vector<std::pair<std::string, const TransportFactory*>> byPreference() {
  std::vector<std::pair<std::string, const TransportFactory*>> all;
  for (auto& kv : transportRegistry()) all.emplace_back(kv.first, &kv.second);
  std::sort(all.begin(), all.end(), [](auto& a, auto& b) {
    return a.second->preference < b.second->preference;
  });
  return all;
}

bool usableCached(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, bool> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  bool ok = false;
  try {
    ok = transportRegistry().at(name).usable();
  } catch (...) {
    ok = false;
  }
  cache[name] = ok;
  return ok;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string bytesToString(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

// Where a job's emulated links keep their state unless DICOMM_LINK_STATE says: one file per job
// (its store's address), so every process group of the job shares the fleet's links.
std::string defaultLinkState() {
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  std::string name = std::string(addr ? addr : "local") + "-" + (port ? port : "0");
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.') c = '_';
  }
  return "/dev/shm/dicomm-links-" + std::to_string(getuid()) + "-" + name;
}

std::string describeLink(const std::string& cls, const LinkPlace& from, const LinkPlace& to,
                         const LinkClassSpec& spec, double scale) {
  std::ostringstream out;
  out << cls << " " << from.dc << "/" << from.node << ">" << to.dc << "/" << to.node << " "
      << spec.bytesPerSecond / 1e9 << " GB/s " << spec.latencySeconds * 1e6 << " us x" << scale;
  return out.str();
}
std::vector<uint8_t> stringToBytes(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

std::vector<std::string> transportsBuilt() {
  std::vector<std::string> names;
  for (auto& kv : byPreference()) names.push_back(kv.first);
  return names;
}

std::vector<std::string> transportsUsable() {
  std::vector<std::string> names;
  for (auto& kv : byPreference()) {
    if (usableCached(kv.first)) names.push_back(kv.first);
  }
  return names;
}

std::string localHostId() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  // Peers in another network namespace cannot reach this one's abstract unix sockets (shm's
  // handshake), so they are other hosts, even under the same hostname and kernel.
  std::string id = std::string(host) + "/" + boot;
  for (const char* kind : {"/proc/self/ns/pid", "/proc/self/ns/net"}) {
    char ns[128] = {0};
    ssize_t n = readlink(kind, ns, sizeof(ns) - 1);
    id += "/" + (n > 0 ? std::string(ns, n) : std::string());
  }
  return id;
}

Communicator::Communicator(CommunicatorOptions options)
    : options_(std::move(options)), mailbox_(options_.rank, options_.onFailure) {
  checkForcedTransport();
  links_ = LinkEmulation::fromEnv(defaultLinkState());
  const std::string myHost = localHostId();
  const std::vector<std::string> myUsable =
      options_.transport == "auto" ? transportsUsable() : std::vector<std::string>{options_.transport};
  const std::vector<uint8_t> authKey = shareAuthKey(myHost, myUsable);
  const int localRanks = choosePairTransports(myHost, myUsable);
  groupHosts();
  connectPairs(startTransports(authKey, localRanks, myHost));
  try {
    paceLinks();
  } catch (...) {
    for (auto& pair : pairs_) {  // held by their own threads: stopped before mailbox_ goes
      if (pair) pair->close();
    }
    throw;
  }
}

void Communicator::checkForcedTransport() const {
  const std::string& forced = options_.transport;
  if (forced == "auto") return;
  if (!transportRegistry().count(forced)) {
    throw std::invalid_argument("dicomm: DICOMM_TRANSPORT='" + forced + "' is not built in; built: " +
                                join(transportsBuilt()) + " (or 'auto')");
  }
  if (!usableCached(forced)) {
    throw std::runtime_error("dicomm: DICOMM_TRANSPORT='" + forced +
                             "' is built but not usable on this machine; usable: " + join(transportsUsable()));
  }
}

void Communicator::waitForKey(const std::string& key, int who) const {
  try {
    options_.store->wait({key}, options_.timeout);
  } catch (const std::exception& e) {
    throw std::runtime_error("dicomm: rank " + std::to_string(who) + " of " + std::to_string(options_.size) +
                             " did not join the process group within " + std::to_string(options_.timeout.count()) +
                             " ms (rank " + std::to_string(options_.rank) + " waited for store key '" + key + "')");
  }
}

std::vector<uint8_t> Communicator::shareAuthKey(const std::string& myHost, const std::vector<std::string>& myUsable) {
  // The shared secret every connection proves: rank 0 creates it. Each rank also publishes its
  // host and usable transports, which choosePairTransports() reads.
  auto& store = options_.store;
  std::vector<uint8_t> authKey(32);
  const std::string authKeyName = std::string(kStorePrefix) + "auth";
  if (options_.rank == 0) {
    std::random_device rd;
    for (auto& b : authKey) b = static_cast<uint8_t>(rd());
    store->set(authKeyName, authKey);
  }
  store->set(std::string(kStorePrefix) + "info/" + std::to_string(options_.rank),
             stringToBytes(myHost + "\n" + join(myUsable) + "\n" + (links_.enabled ? links_.place.encode() : "")));
  if (options_.rank != 0) {
    waitForKey(authKeyName, 0);
    authKey = store->get(authKeyName);
  }
  return authKey;
}

int Communicator::choosePairTransports(const std::string& myHost, const std::vector<std::string>& myUsable) {
  // Per peer: the most preferred transport both ranks can use and that reaches.
  const int rank = options_.rank, size = options_.size;
  pairTransport_.assign(size, "self");
  peerHost_.assign(size, myHost);
  peerPlace_.assign(size, links_.place);
  pairLink_.assign(size, "");
  int localRanks = 1;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const std::string key = std::string(kStorePrefix) + "info/" + std::to_string(p);
    waitForKey(key, p);
    std::string info = bytesToString(options_.store->get(key));
    size_t nl = info.find('\n');
    std::string peerHost = info.substr(0, nl);
    size_t nl2 = info.find('\n', nl + 1);
    std::vector<std::string> peerUsable = split(info.substr(nl + 1, nl2 == std::string::npos ? nl2 : nl2 - nl - 1));
    const std::string peerPlace = nl2 == std::string::npos ? "" : info.substr(nl2 + 1);
    if (links_.enabled != !peerPlace.empty()) {
      throw std::runtime_error("dicomm: rank " + std::to_string(rank) + (links_.enabled ? " emulates" : " does not emulate") +
                               " links (DICOMM_LINKS) but rank " + std::to_string(p) +
                               (links_.enabled ? " does not" : " does") + "; set it on every rank or on none");
    }
    if (links_.enabled) peerPlace_[p] = LinkPlace::parse(peerPlace, "rank " + std::to_string(p) + "'s DICOMM_LINK_PLACE");
    if (peerHost == myHost) ++localRanks;
    std::string chosen;
    for (auto& [name, factory] : byPreference()) {
      bool mine = std::count(myUsable.begin(), myUsable.end(), name) > 0;
      bool theirs = std::count(peerUsable.begin(), peerUsable.end(), name) > 0;
      if (mine && theirs && factory->reaches(myHost, peerHost)) {
        chosen = name;
        break;
      }
    }
    if (chosen.empty()) {
      throw std::runtime_error("dicomm: no transport connects rank " + std::to_string(rank) + " (host " + myHost +
                               ", usable " + join(myUsable) + ") to rank " + std::to_string(p) + " (host " +
                               peerHost + ", usable " + join(peerUsable) + ")");
    }
    pairTransport_[p] = chosen;
    peerHost_[p] = peerHost;
  }
  return localRanks;
}

void Communicator::groupHosts() {
  // Emulated nodes of one host are hosts of their own here: a collective across them takes the
  // pairs (and their emulated links), not the host's shared memory.
  auto sameHost = [&](int a, int b) {
    return peerHost_[a] == peerHost_[b] &&
           (!links_.enabled || (peerPlace_[a].dc == peerPlace_[b].dc && peerPlace_[a].node == peerPlace_[b].node));
  };
  for (int p = 0; p < options_.size; ++p) {
    auto known = std::find_if(hosts_.begin(), hosts_.end(), [&](const std::vector<int>& h) { return sameHost(h[0], p); });
    if (known == hosts_.end()) {
      hostIndex_.push_back(static_cast<int>(hosts_.size()));
      hosts_.push_back({p});
    } else {
      hostIndex_.push_back(static_cast<int>(known - hosts_.begin()));
      known->push_back(p);
    }
  }
}

std::map<std::string, Transport*> Communicator::startTransports(const std::vector<uint8_t>& authKey, int localRanks,
                                                                const std::string& myHost) {
  TransportContext ctx;
  ctx.store = options_.store;
  ctx.keyPrefix = kStorePrefix;
  ctx.rank = options_.rank;
  ctx.size = options_.size;
  ctx.timeout = options_.timeout;
  ctx.inbox = &mailbox_;
  ctx.listen = chooseListenAddress(options_.listenHost, storeHostOf(options_.store));
  checkListenReaches(ctx.listen, myHost);
  logLine(LogLevel::kInfo, "rank " + std::to_string(options_.rank) + " of " + std::to_string(options_.size) +
                               ": listens on " + ctx.listen.host +
                               (ctx.listen.interface.empty() ? "" : " (" + ctx.listen.interface + ")") +
                               ", chosen by " + ctx.listen.reason + "; transports " + describeTransports());
  ctx.authKey = authKey;
  ctx.localRanks = localRanks;
  std::set<std::string> needed;
  for (int p = 0; p < options_.size; ++p)
    if (p != options_.rank) needed.insert(pairTransport_[p]);
  std::map<std::string, Transport*> started;
  for (const std::string& name : needed) {
    transports_.push_back(transportRegistry().at(name).create());
    transports_.back()->start(ctx);
    started[name] = transports_.back().get();
  }
  return started;
}

void Communicator::connectPairs(const std::map<std::string, Transport*>& started) {
  pairs_.resize(options_.size);
  try {
    for (int p = 0; p < options_.size; ++p) {
      if (p == options_.rank) continue;
      pairs_[p] = started.at(pairTransport_[p])->connect(p);
    }
  } catch (...) {
    // The pairs already up are held by their own threads: stop them before mailbox_ goes.
    for (auto& pair : pairs_) {
      if (pair) pair->close();
    }
    throw;
  }
}

void Communicator::paceLinks() {
  if (!links_.enabled) return;
  std::shared_ptr<LinkState> state = LinkState::open(links_.statePath);
  const LinkPlace& me = links_.place;
  // The link's name says what shares it: a DC pair's one link per direction; a rank's NIC (by
  // its process: one chip, whatever group it sends in); a rank's scale-up port.
  const std::string chip = std::to_string(getpid());
  for (int p = 0; p < options_.size; ++p) {
    if (!pairs_[p]) continue;
    const LinkPlace& peer = peerPlace_[p];
    const std::string cls = LinkEmulation::classBetween(me, peer);
    auto named = links_.classes.find(cls);
    if (named == links_.classes.end()) continue;  // a class the cluster does not name: host speed
    LinkClassSpec spec = named->second;
    if (cls != "intra_node") {
      for (double nic : {me.nicBytesPerSecond, peer.nicBytesPerSecond}) {
        if (nic > 0) spec.bytesPerSecond = std::min(spec.bytesPerSecond, nic);
      }
    }
    const std::string id = cls == "inter_cluster" ? "c|" + me.dc + "|" + peer.dc
                           : cls == "inter_node"  ? "n|" + chip
                                                  : "i|" + chip;
    pairLink_[p] = describeLink(cls, me, peer, spec, links_.timeScale);
    pairs_[p] = PacedPair::wrap(pairs_[p], state, state->slot(id), spec, links_.timeScale, pairLink_[p],
                                [](uint64_t tag) { return isControlTag(tag); });
  }
  logLine(LogLevel::kInfo, "rank " + std::to_string(options_.rank) + ": emulated links at " + me.encode() +
                               " (state " + links_.statePath + ")");
}

std::string Communicator::linkOf(int peer) const { return pairLink_.at(peer); }

void Communicator::checkListenReaches(const ListenAddress& listen, const std::string& myHost) const {
  if (!listen.loopback) return;
  std::string remote;
  for (int p = 0; p < size(); ++p) {
    if (pairTransport_[p] == "tcp" && peerHost_[p] != myHost) {
      remote += (remote.empty() ? "" : ", ") + std::to_string(p);
    }
  }
  if (remote.empty()) return;
  throw std::runtime_error(
      "dicomm: rank " + std::to_string(rank()) + " would listen on loopback address " +
      listen.host + " (chosen by " + listen.reason + "), but ranks " + remote +
      " are on other hosts and could not reach it; set DICOMM_SOCKET_IFNAME to the interface "
      "that reaches them (or DICOMM_LISTEN_HOST to an address of this host)");
}

std::string Communicator::describeTransports() const {
  std::map<std::string, std::string> ranks;
  for (int p = 0; p < size(); ++p) {
    if (p == rank()) continue;
    auto& r = ranks[pairTransport_[p]];
    r += (r.empty() ? "" : ",") + std::to_string(p);
  }
  std::string out;
  for (auto& [name, peers] : ranks) out += (out.empty() ? "" : "; ") + name + " to ranks " + peers;
  return out.empty() ? "none (a group of one)" : out;
}

Communicator::~Communicator() {
  close(std::make_exception_ptr(std::runtime_error("dicomm: communicator destroyed")));
}

std::string Communicator::transportOf(int peer) const { return pairTransport_.at(peer); }

int Communicator::connectionsOf(int peer) const {
  const auto& pair = pairs_.at(peer);
  return pair ? pair->connections() : 0;
}

std::string Communicator::congestionOf(int peer) const {
  const auto& pair = pairs_.at(peer);
  return pair ? pair->congestion() : "";
}

bool Communicator::progress(int peer, const std::atomic<bool>& done,
                            std::chrono::steady_clock::time_point until, bool block) {
  if (closed_ || peer < 0 || peer >= size() || !pairs_[peer]) return false;
  // Held here: a completion handled on this thread may close the group and release it.
  const std::shared_ptr<Pair> pair = pairs_[peer];
  return pair->progress(done, until, block);
}

bool Communicator::awaitReading(Communicator* comm, int peer, const std::atomic<bool>& done,
                                std::chrono::steady_clock::time_point blockUntil) {
  {
    PollPhase poll;
    const bool polls = poll.budget().count() > 0;
    if (polls) {
      // The budget came from the last sample; one taken while polling may find the host busy.
      const auto spinUntil = std::chrono::steady_clock::now() + poll.budget();
      for (unsigned round = 0; !done.load(std::memory_order_acquire) && !hostBusy() &&
                               std::chrono::steady_clock::now() < spinUntil;
           ++round) {
        if (comm && comm->progress(peer, done, spinUntil)) continue;  // it samples when idle
        if (round == 0) sampleHostLoad(/*callerPolls=*/true);           // idle now: see Spin.h
        std::this_thread::yield();
      }
    }
    if (comm && !done.load(std::memory_order_acquire) && (!polls || hostBusy())) {
      trace::mark(trace::kWaitBlocks);
      comm->progress(peer, done, blockUntil, /*block=*/true);
    }
  }
  if (done.load(std::memory_order_acquire)) return true;
  if (comm) comm->unpark(peer);
  return false;
}

void Communicator::unpark(int peer) {
  if (closed_) return;
  if (peer >= 0) {
    if (peer < size() && pairs_[peer]) pairs_[peer]->unpark();
    return;
  }
  for (auto& pair : pairs_) {
    if (pair) pair->unpark();
  }
}

namespace {
thread_local uint64_t postedHere = 0;
}  // namespace

uint64_t Communicator::postedByThisThread() { return postedHere; }

std::shared_ptr<Completion> Communicator::isend(int peer, uint64_t tag, const void* data,
                                                size_t nbytes, int32_t dtype,
                                                Completion::Callback cb) {
  auto c = std::make_shared<Completion>(std::move(cb));
  if (peer < 0 || peer >= size() || peer == rank()) {
    c->complete(std::make_exception_ptr(std::invalid_argument(
        "dicomm: send to rank " + std::to_string(peer) + ": expected a peer rank in [0, " +
        std::to_string(size()) + ") other than this rank " + std::to_string(rank()))));
    return c;
  }
  Envelope env;
  env.tag = tag;
  env.nbytes = nbytes;
  env.dtype = dtype;
  if (closed_) {
    c->complete(std::make_exception_ptr(std::runtime_error("dicomm: communicator is closed")));
    return c;
  }
  ++postedHere;
  pairs_[peer]->send(env, data, MemoryKind::kHost,
                     [c, peer](std::exception_ptr e) { c->complete(e, peer); });
  return c;
}

std::shared_ptr<Completion> Communicator::irecv(int peer, uint64_t tag, void* data, size_t nbytes,
                                                int32_t dtype, Completion::Callback cb) {
  auto c = std::make_shared<Completion>(std::move(cb));
  if (peer < -1 || peer >= size() || peer == rank()) {
    c->complete(std::make_exception_ptr(std::invalid_argument(
        "dicomm: recv from rank " + std::to_string(peer) + ": expected a peer rank in [0, " +
        std::to_string(size()) + ") other than this rank " + std::to_string(rank()))));
    return c;
  }
  if (closed_) {
    c->complete(std::make_exception_ptr(std::runtime_error("dicomm: communicator is closed")));
    return c;
  }
  RecvRequest r;
  r.peer = peer;
  r.tag = tag;
  r.data = data;
  r.nbytes = nbytes;
  r.dtype = dtype;
  r.completion = c;
  ++postedHere;
  mailbox_.post(std::move(r));
  return c;
}

void Communicator::close(const std::exception_ptr& error) {
  std::lock_guard<std::mutex> lock(closeMu_);
  if (closed_.exchange(true)) return;
  try {
    if (error) std::rethrow_exception(error);
  } catch (const std::exception& e) {
    closeCause_ = e.what();
  } catch (...) {
    closeCause_ = "closed";
  }
  for (auto& p : pairs_) {
    if (p) p->close();
  }
  mailbox_.failAll(error);
}

std::string Communicator::closeCause() const {
  std::lock_guard<std::mutex> lock(closeMu_);
  return closeCause_;
}

void Communicator::abort(const std::string& cause) {
  if (!closed_) {
    auto text = std::make_shared<std::string>(cause.substr(0, 1 << 16));
    Envelope env;
    env.tag = abortNoticeTag();
    env.nbytes = text->size();
    for (auto& p : pairs_) {
      if (p) p->send(env, text->data(), MemoryKind::kHost, [text](std::exception_ptr) {});
    }
  }
  close(std::make_exception_ptr(std::runtime_error(cause)));
}

}  // namespace dicomm
