// tcp: CPU-mediated transport over one TCP connection per peer; works between any two hosts.
#include "comm/transport/StreamConfig.h"
#include "comm/transport/StreamTransport.h"

namespace dicomm {
namespace {

TransportFactory tcpFactory() {
  TransportFactory f;
  f.usable = [] { return true; };
  f.reaches = [](const std::string&, const std::string&) { return true; };
  f.create = [] {
    StreamConfig c;
    c.name = "tcp";
    c.tcp = true;
    c.applyEnv();
    return std::unique_ptr<Transport>(new StreamTransport(c));
  };
  f.preference = 30;
  return f;
}

}  // namespace
}  // namespace dicomm

DICOMM_REGISTER_TRANSPORT(tcp, ::dicomm::tcpFactory());
