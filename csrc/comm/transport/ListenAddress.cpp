#include "comm/transport/ListenAddress.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/transport/Socket.h"

namespace dicomm {

namespace {

// AF_UNSPEC, AF_INET or AF_INET6 from DICOMM_SOCKET_FAMILY.
int familyFromEnv() {
  const char* v = std::getenv("DICOMM_SOCKET_FAMILY");
  if (!v || !*v) return AF_UNSPEC;
  const std::string s(v);
  if (s == "AF_INET" || s == "inet" || s == "4") return AF_INET;
  if (s == "AF_INET6" || s == "inet6" || s == "6") return AF_INET6;
  throw std::invalid_argument("dicomm: DICOMM_SOCKET_FAMILY='" + s +
                              "': expected AF_INET or AF_INET6 (or unset for either)");
}

bool isLoopback(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr) >> 24) == 127;
  }
  if (sa->sa_family == AF_INET6) {
    return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
  }
  return false;
}

bool isLinkLocal(const sockaddr* sa) {
  return sa->sa_family == AF_INET6 &&
         IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
}

// Numeric form; link-local IPv6 with "%<interface>".
std::string numeric(const sockaddr* sa) {
  char ip[INET6_ADDRSTRLEN] = {0};
  if (sa->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, ip, sizeof(ip));
    return ip;
  }
  const auto* a6 = reinterpret_cast<const sockaddr_in6*>(sa);
  inet_ntop(AF_INET6, &a6->sin6_addr, ip, sizeof(ip));
  std::string s(ip);
  char name[IF_NAMESIZE] = {0};
  if (a6->sin6_scope_id != 0 && if_indextoname(a6->sin6_scope_id, name)) s += std::string("%") + name;
  return s;
}

bool sameAddress(const sockaddr* a, const sockaddr* b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                     &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
}

struct IfAddrs {
  ifaddrs* list = nullptr;
  IfAddrs() {
    if (getifaddrs(&list) != 0) list = nullptr;
  }
  ~IfAddrs() {
    if (list) freeifaddrs(list);
  }
};

bool usableEntry(const ifaddrs* ifa, int family) {
  if (!ifa->ifa_addr || !(ifa->ifa_flags & IFF_UP)) return false;
  const int f = ifa->ifa_addr->sa_family;
  if (f != AF_INET && f != AF_INET6) return false;
  return family == AF_UNSPEC || f == family;
}

std::string interfaceHolding(const sockaddr* sa) {
  IfAddrs all;
  for (ifaddrs* ifa = all.list; ifa; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr && sameAddress(ifa->ifa_addr, sa)) return ifa->ifa_name;
  }
  return "";
}

std::string describeInterfaces(int family) {
  IfAddrs all;
  std::string out;
  for (ifaddrs* ifa = all.list; ifa; ifa = ifa->ifa_next) {
    if (!usableEntry(ifa, family)) continue;
    out += (out.empty() ? "" : ", ") + std::string(ifa->ifa_name) + " (" + numeric(ifa->ifa_addr) + ")";
  }
  return out.empty() ? "none" : out;
}

ListenAddress fromSockaddr(const sockaddr* sa, const std::string& reason) {
  ListenAddress a;
  a.host = numeric(sa);
  a.interface = interfaceHolding(sa);
  a.reason = reason;
  a.loopback = isLoopback(sa);
  return a;
}

// The DICOMM_SOCKET_IFNAME interfaces, in the order named; per interface IPv4 first, then global
// IPv6, then link-local IPv6.
bool fromInterfaceNames(const std::string& names, int family, ListenAddress* out) {
  std::stringstream ss(names);
  std::string name;
  IfAddrs all;
  while (std::getline(ss, name, ',')) {
    if (name.empty()) continue;
    for (int rank = 0; rank < 3; ++rank) {
      for (ifaddrs* ifa = all.list; ifa; ifa = ifa->ifa_next) {
        if (name != ifa->ifa_name || !usableEntry(ifa, family)) continue;
        const sockaddr* sa = ifa->ifa_addr;
        const int r = sa->sa_family == AF_INET ? 0 : isLinkLocal(sa) ? 2 : 1;
        if (r != rank) continue;
        *out = fromSockaddr(sa, "DICOMM_SOCKET_IFNAME=" + names);
        return true;
      }
    }
  }
  return false;
}

// The local address the kernel would send from to reach `host` (a UDP connect sends nothing).
bool routeTo(const std::string& host, int family, ListenAddress* out) {
  addrinfo hints{};
  hints.ai_family = family;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0) return false;
  bool found = false;
  for (addrinfo* ai = res; ai && !found; ai = ai->ai_next) {
    Fd probe(::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!probe || ::connect(probe.get(), ai->ai_addr, ai->ai_addrlen) != 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (getsockname(probe.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
    *out = fromSockaddr(reinterpret_cast<sockaddr*>(&local), "the route to the store at " + host);
    found = true;
  }
  freeaddrinfo(res);
  return found;
}

// gloo's default: this host's name resolved, if an address of it can be bound.
bool fromHostname(int family, ListenAddress* out) {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0) return false;
  addrinfo hints{};
  hints.ai_family = family;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(name, nullptr, &hints, &res) != 0) return false;
  bool found = false;
  for (addrinfo* ai = res; ai && !found; ai = ai->ai_next) {
    Fd probe(::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!probe || ::bind(probe.get(), ai->ai_addr, ai->ai_addrlen) != 0) continue;
    *out = fromSockaddr(ai->ai_addr, "this host's name " + std::string(name));
    found = true;
  }
  freeaddrinfo(res);
  return found;
}

}  // namespace

ListenAddress chooseListenAddress(const std::string& explicitHost, const std::string& storeHost) {
  const int family = familyFromEnv();
  ListenAddress chosen;
  if (!explicitHost.empty()) {
    chosen.host = explicitHost;
    chosen.interface = "";
    chosen.reason = "DICOMM_LISTEN_HOST";
    chosen.loopback = explicitHost == "localhost" || explicitHost.rfind("127.", 0) == 0 ||
                      explicitHost == "::1";
    return chosen;
  }
  const char* names = std::getenv("DICOMM_SOCKET_IFNAME");
  if (names && *names) {
    if (fromInterfaceNames(names, family, &chosen)) return chosen;
    throw std::invalid_argument(std::string("dicomm: DICOMM_SOCKET_IFNAME='") + names +
                                "': no such interface is up with an address" +
                                (family == AF_INET ? " of family AF_INET" :
                                 family == AF_INET6 ? " of family AF_INET6" : "") +
                                "; interfaces here: " + describeInterfaces(family));
  }
  if (!storeHost.empty() && routeTo(storeHost, family, &chosen)) return chosen;
  if (fromHostname(family, &chosen)) return chosen;
  chosen.host = family == AF_INET6 ? "::1" : "127.0.0.1";
  chosen.interface = "lo";
  chosen.reason = "loopback (no route to a store address and no address for this host's name)";
  chosen.loopback = true;
  return chosen;
}

std::string storeHostOf(const c10::intrusive_ptr<c10d::Store>& store) {
  c10::intrusive_ptr<c10d::Store> s = store;
  for (int depth = 0; s && depth < 16; ++depth) {
    if (auto* tcp = dynamic_cast<c10d::TCPStore*>(s.get())) return tcp->getHost();
    auto* prefix = dynamic_cast<c10d::PrefixStore*>(s.get());
    if (!prefix) break;
    s = prefix->getUnderlyingStore();
  }
  const char* master = std::getenv("MASTER_ADDR");
  return master ? master : "";
}

std::string scopedForDialing(const std::string& host, const ListenAddress& mine) {
  const size_t pct = host.find('%');
  if (pct == std::string::npos) return host;
  std::string scope;
  if (!mine.interface.empty() && mine.interface != "lo") scope = mine.interface;
  const size_t myPct = mine.host.find('%');
  if (myPct != std::string::npos) scope = mine.host.substr(myPct + 1);
  return scope.empty() ? host : host.substr(0, pct) + "%" + scope;
}

bool splitTcpAddress(const std::string& address, std::string* host, std::string* port) {
  if (address.rfind("tcp:", 0) != 0) return false;
  const std::string hostport = address.substr(4);
  if (!hostport.empty() && hostport[0] == '[') {
    const size_t close = hostport.find("]:");
    if (close == std::string::npos) return false;
    *host = hostport.substr(1, close - 1);
    *port = hostport.substr(close + 2);
  } else {
    const size_t colon = hostport.rfind(':');
    if (colon == std::string::npos) return false;
    *host = hostport.substr(0, colon);
    *port = hostport.substr(colon + 1);
  }
  return !host->empty() && !port->empty() &&
         port->find_first_not_of("0123456789") == std::string::npos && port->size() <= 5;
}

std::string joinTcpAddress(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return std::string("tcp:") + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace dicomm
