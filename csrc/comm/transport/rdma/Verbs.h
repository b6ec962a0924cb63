// Thin libibverbs layer for the rdma transport: which device and port to use, owned verbs
// objects, and error text that names the op, the peer and the verbs status.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <string>

namespace dicomm {
namespace rdma {

// Owned verbs handles (the deleters call ibv_*_destroy/close/dealloc/dereg).
struct VerbsDeleter {
  void operator()(ibv_context* p) const;
  void operator()(ibv_pd* p) const;
  void operator()(ibv_comp_channel* p) const;
  void operator()(ibv_cq* p) const;
  void operator()(ibv_qp* p) const;
  void operator()(ibv_mr* p) const;
};
template <class T>
using Owned = std::unique_ptr<T, VerbsDeleter>;

// The device, port and GID this process uses.
struct DeviceChoice {
  std::string name;
  int port = 1;
  int gidIndex = -1;  // -1: InfiniBand link layer, address by LID
  bool roce = false;
};

// Resolves DICOMM_IB_DEVICE (`dev[:port]`, or a comma list indexed by LOCAL_RANK; the grammar
// of dicomm.topology.parse_ib_device, which writes the affinity choice into it) or, without
// it, the first device with an active port. DICOMM_IB_GID_INDEX overrides the GID: by default
// a RoCE v2 IPv4-mapped GID, then any RoCE v2 one, then index 0. Throws std::runtime_error
// with the reason when nothing usable exists.
DeviceChoice chooseDevice();

// Why the rdma transport is not usable here ("" if it is). Cheap; opens the device once.
std::string unusableReason();

// Opens `choice.name`; throws naming the device.
Owned<ibv_context> openDevice(const DeviceChoice& choice);

// "rdma: <op> <to|from> rank <peer> failed: <status text> (status <n>, vendor error 0x..)"
std::string wcError(const char* op, const char* direction, int peer, const ibv_wc& wc);
// "rdma: <op> for rank <peer> failed: <strerror(err)>"
std::string callError(const char* op, int peer, int err);

}  // namespace rdma
}  // namespace dicomm
