#include "comm/transport/StreamConfig.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "comm/transport/Env.h"
#include "comm/transport/Socket.h"
#include "comm/transport/Spin.h"

namespace dicomm {

void StreamConfig::applyEnv() {
  spin = spinBudget();
  socketBuffer = static_cast<int>(envLong("DICOMM_SOCKET_BUFFER", socketBuffer, 0, 1 << 30));
  if (!tcp) smallFrameRing = envLong("DICOMM_SHM_RING", 1, 0, 1) == 1;
  if (tcp) {
    rendezvousThreshold = static_cast<size_t>(
        envLong("DICOMM_RENDEZVOUS_BYTES", rendezvousThreshold, 0, 1L << 40));
    lanes = static_cast<int>(envLong("DICOMM_TCP_STREAMS", defaultLanes(), 1, 16));
    stripeMin = static_cast<size_t>(envLong("DICOMM_STRIPE_BYTES", stripeMin, 4096, 1L << 40));
    peerTimeoutS = static_cast<int>(envLong("DICOMM_PEER_TIMEOUT", peerTimeoutS, 0, 86400));
    connectTimeoutS = static_cast<int>(envLong("DICOMM_CONNECT_TIMEOUT", connectTimeoutS, 1, 86400));
    const char* cc = std::getenv("DICOMM_TCP_CONGESTION");
    if (cc && *cc) congestion = cc;
    if (congestion != "auto" && congestion != "system") {
      if (const int err = congestionAllowed(congestion)) {
        throw std::invalid_argument(
            "dicomm: DICOMM_TCP_CONGESTION='" + congestion + "': the kernel refuses it (" +
            errnoString(err) + "); expected 'auto', 'system' or an algorithm listed in " +
            "/proc/sys/net/ipv4/tcp_allowed_congestion_control");
      }
    }
  }
}

std::string StreamConfig::congestionFor(int fd) const {
  if (!tcp || congestion == "system") return "";
  if (congestion == "auto") return hostLocal(fd) ? "reno" : "";
  return congestion;
}

int StreamConfig::defaultLanes() {
  // One stream per core, up to 4: each stream keeps a sending and a receiving thread busy.
  unsigned cpus = std::thread::hardware_concurrency();
  return static_cast<int>(std::max(1u, std::min(4u, cpus)));
}

}  // namespace dicomm
