// Where a rank listens for its peers, chosen the way gloo and NCCL choose it: the address of the
// interface that routes to the c10d store (which every rank of the job already reaches), unless
// the user names interfaces (DICOMM_SOCKET_IFNAME) or an address (DICOMM_LISTEN_HOST).
#pragma once

#include <string>

// The store only by name: c10d's Store.hpp brings torch/custom_class.h (about 3 s of a 2-core
// host's compile in every file of the transport layer); the files that call the store or own a
// TransportContext include it themselves.
#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Store;
}  // namespace c10d

namespace dicomm {

struct ListenAddress {
  // Numeric address; an IPv6 link-local one carries its scope: fe80::1%eth0. The default (a
  // transport used without a Communicator, as in tests) is loopback.
  std::string host = "127.0.0.1";
  std::string interface = "lo";  // the interface holding it ("" when unknown)
  std::string reason = "the default";  // how it was chosen, for the debug log and for errors
  bool loopback = true;
};

// In order: `explicitHost` (DICOMM_LISTEN_HOST) when non-empty; the interfaces named by
// DICOMM_SOCKET_IFNAME (comma-separated, first match wins); the interface that routes to
// `storeHost`; this host's name, resolved; loopback. DICOMM_SOCKET_FAMILY (AF_INET or AF_INET6)
// restricts every automatic choice to one family. Throws std::invalid_argument naming the
// variable for a bad value or a named interface without a usable address.
ListenAddress chooseListenAddress(const std::string& explicitHost, const std::string& storeHost);

// The host a TCPStore behind `store` (through any PrefixStores) connects to, else MASTER_ADDR,
// else "".
std::string storeHostOf(const c10::intrusive_ptr<c10d::Store>& store);

// A published IPv6 link-local address names the publisher's interface as its scope, which means
// nothing on this host: dial it through this rank's own listening interface instead. Other
// addresses are returned unchanged. `host` is numeric, without brackets.
std::string scopedForDialing(const std::string& host, const ListenAddress& mine);

// "tcp:10.0.0.1:4000" / "tcp:[fe80::1%eth0]:4000" -> host and port; false when malformed.
bool splitTcpAddress(const std::string& address, std::string* host, std::string* port);
// The inverse: brackets around an IPv6 host.
std::string joinTcpAddress(const std::string& host, int port);

}  // namespace dicomm
