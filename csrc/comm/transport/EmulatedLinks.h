// Emulated links: the bandwidth and latency of the fleet a run stands for, at the job's time
// scale, instead of this host's loopback and shared memory.
//
// A rank is placed in the fleet by DICOMM_LINK_PLACE ("DC/NODE" or "DC/NODE/NIC_GBPS"); the link
// classes by DICOMM_LINKS ("inter_node=GBPS:LATENCY_US,inter_cluster=GBPS:LATENCY_US[,intra_node=..]");
// the time scale by DITORCH_TIME_SCALE (the chips' own, default 1). Two ranks on one node talk
// over intra_node, on two nodes of one DC over inter_node, across DCs over inter_cluster; between
// two nodes the bandwidth is also bounded by both ends' NICs. A class the variable does not name
// runs at host speed. A message of n bytes takes (latency + n / bandwidth) * time scale.
//
// Links are shared the way the fleet's are: inter_cluster is one link per direction between two
// DCs, whatever pairs cross it; inter_node is the sending rank's NIC; intra_node its scale-up
// port. A link's state (when it is next free) lives in a file every rank of the job maps
// (DICOMM_LINK_STATE; one machine's ranks, emulated hosts included, share it), and a message
// takes the link one quantum at a time, so concurrent messages interleave as a fair link's
// flows do (heteropp/simulator.py's processor sharing). PacedPair.h applies it to a pair.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace dicomm {

struct LinkClassSpec {
  double bytesPerSecond = 0;
  double latencySeconds = 0;
};

// Where a rank sits: its DC, its node, and its NIC's bandwidth (0: not stated).
struct LinkPlace {
  std::string dc;
  std::string node;
  double nicBytesPerSecond = 0;

  std::string encode() const;
  // Throws std::invalid_argument naming `source` and the value.
  static LinkPlace parse(const std::string& text, const std::string& source);
};

// The emulation as this rank's environment states it.
struct LinkEmulation {
  bool enabled = false;  // DICOMM_LINKS set
  std::map<std::string, LinkClassSpec> classes;
  LinkPlace place;
  double timeScale = 1;
  std::string statePath;

  // Reads DICOMM_LINKS, DICOMM_LINK_PLACE, DITORCH_TIME_SCALE and DICOMM_LINK_STATE; throws
  // std::invalid_argument naming the variable and its value when one is malformed or out of
  // range (a class with no bandwidth, bandwidth outside [1e-6, 1e5] GB/s, latency outside
  // [0, 1e7] us, a time scale below 1). `defaultState`: the state file when DICOMM_LINK_STATE
  // is unset.
  static LinkEmulation fromEnv(const std::string& defaultState);

  // The class two places talk over ("intra_node", "inter_node", "inter_cluster").
  static std::string classBetween(const LinkPlace& a, const LinkPlace& b);
};

// A link's occupancy, shared by every process that maps the same state file: the time (steady
// clock, ns) until which it is taken.
class LinkState {
 public:
  // The state file at `path`, mapped once per process. Throws naming the path.
  static std::shared_ptr<LinkState> open(const std::string& path);
  ~LinkState();

  // The occupancy slot of the link called `id` (claimed on first use, in any process).
  std::atomic<int64_t>* slot(const std::string& id);

  // Takes the link for `durationNs` from max(now, when it is free), or from `continueFrom`
  // when the link has stayed free since this caller's last quantum ended there (a sender that
  // woke late loses no link time). Returns the start. Lock-free: a compare-and-swap retried
  // only when another process took the link meanwhile.
  static int64_t reserve(std::atomic<int64_t>* link, int64_t durationNs, int64_t continueFrom);

 private:
  LinkState(const std::string& path, void* base, size_t bytes);
  std::string path_;
  void* base_;
  size_t bytes_;
};

int64_t steadyNowNs();

}  // namespace dicomm
