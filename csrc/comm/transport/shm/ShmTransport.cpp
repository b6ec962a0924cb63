// shm: the intra-host direct path. Control frames and small messages go over an AF_UNIX socket;
// payloads from 64 KiB up are copied once, straight from the sender's memory into the
// receiver's buffer, with process_vm_readv (cross-memory attach).
#include "comm/transport/CrossMemory.h"
#include "comm/transport/StreamConfig.h"
#include "comm/transport/StreamTransport.h"

namespace dicomm {
namespace {

TransportFactory shmFactory() {
  TransportFactory f;
  f.usable = [] { return crossMemoryAttachWorks(); };
  // Host ids include the boot id and the pid namespace, so "same host" means "can attach".
  f.reaches = [](const std::string& mine, const std::string& theirs) { return mine == theirs; };
  f.create = [] {
    StreamConfig c;
    c.name = "shm";
    c.tcp = false;
    c.remoteThreshold = 64 << 10;
    c.applyEnv();
    return std::unique_ptr<Transport>(new StreamTransport(c));
  };
  f.preference = 20;
  return f;
}

}  // namespace
}  // namespace dicomm

DICOMM_REGISTER_TRANSPORT(shm, ::dicomm::shmFactory());
