#include "comm/transport/Transport.h"

namespace dicomm {

std::map<std::string, TransportFactory>& transportRegistry() {
  // Function-local static: transports register from static initializers in any order.
  static std::map<std::string, TransportFactory> registry;
  return registry;
}

}  // namespace dicomm
