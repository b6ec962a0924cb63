#include "comm/transport/rdma/Verbs.h"
#include "comm/transport/Env.h"

#include <errno.h>
#include <string.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <vector>

namespace dicomm {
namespace rdma {

void VerbsDeleter::operator()(ibv_context* p) const { ibv_close_device(p); }
void VerbsDeleter::operator()(ibv_pd* p) const { ibv_dealloc_pd(p); }
void VerbsDeleter::operator()(ibv_comp_channel* p) const { ibv_destroy_comp_channel(p); }
void VerbsDeleter::operator()(ibv_cq* p) const { ibv_destroy_cq(p); }
void VerbsDeleter::operator()(ibv_qp* p) const { ibv_destroy_qp(p); }
void VerbsDeleter::operator()(ibv_mr* p) const { ibv_dereg_mr(p); }

namespace {

struct DeviceList {
  int n = 0;
  ibv_device** list = nullptr;
  DeviceList() { list = ibv_get_device_list(&n); }
  ~DeviceList() {
    if (list) ibv_free_device_list(list);
  }
};


// The DICOMM_IB_DEVICE entry for this local rank: "dev[:port]".
bool requestedDevice(std::string* name, int* port) {
  const char* v = getenv("DICOMM_IB_DEVICE");
  if (!v || !*v) return false;
  std::vector<std::string> entries;
  std::string cur;
  for (const char* c = v;; ++c) {
    if (*c == ',' || *c == '\0') {
      size_t b = cur.find_first_not_of(' '), e = cur.find_last_not_of(' ');
      if (b != std::string::npos) entries.push_back(cur.substr(b, e - b + 1));
      cur.clear();
      if (*c == '\0') break;
    } else {
      cur += *c;
    }
  }
  if (entries.empty()) {
    throw std::invalid_argument(std::string("dicomm rdma: DICOMM_IB_DEVICE='") + v +
                                "': expected 'dev[:port]' or a comma list of them");
  }
  int localRank = static_cast<int>(envLong("LOCAL_RANK", 0, 0, 1 << 20));
  const std::string& entry = entries[static_cast<size_t>(localRank) % entries.size()];
  size_t colon = entry.find(':');
  *name = entry.substr(0, colon);
  *port = 1;
  if (colon != std::string::npos) {
    char* end = nullptr;
    long p = strtol(entry.c_str() + colon + 1, &end, 10);
    if (*end != '\0' || p < 1) {
      throw std::invalid_argument(std::string("dicomm rdma: DICOMM_IB_DEVICE='") + v +
                                  "': entry '" + entry + "' is not 'dev[:port]' with port >= 1");
    }
    *port = static_cast<int>(p);
  }
  if (name->empty()) {
    throw std::invalid_argument(std::string("dicomm rdma: DICOMM_IB_DEVICE='") + v +
                                "': empty device name");
  }
  return true;
}

bool isIpv4Mapped(const ibv_gid& g) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(g.raw, prefix, sizeof(prefix)) == 0;
}

// Picks the GID index on a RoCE port; -1 if the table is empty.
int chooseGid(ibv_context* ctx, int port, int tableLen) {
  int forced = static_cast<int>(envLong("DICOMM_IB_GID_INDEX", -1, -1, 1 << 16));
  if (forced >= 0) return forced;
  int anyV2 = -1, first = -1;
  for (int i = 0; i < tableLen; ++i) {
    ibv_gid_entry entry;
    if (ibv_query_gid_ex(ctx, static_cast<uint32_t>(port), static_cast<uint32_t>(i), &entry, 0)) {
      continue;  // an empty slot
    }
    bool zero = true;
    for (uint8_t b : entry.gid.raw) zero = zero && b == 0;
    if (zero) continue;
    if (first < 0) first = i;
    if (entry.gid_type == IBV_GID_TYPE_ROCE_V2) {
      if (isIpv4Mapped(entry.gid)) return i;
      if (anyV2 < 0) anyV2 = i;
    }
  }
  return anyV2 >= 0 ? anyV2 : first;
}

// Fills `choice` for an opened device/port; returns "" or why the port is unusable.
std::string describePort(ibv_context* ctx, DeviceChoice* choice) {
  ibv_port_attr attr;
  if (ibv_query_port(ctx, static_cast<uint8_t>(choice->port), &attr)) {
    return "port " + std::to_string(choice->port) + " cannot be queried";
  }
  if (attr.state != IBV_PORT_ACTIVE) {
    return "port " + std::to_string(choice->port) + " is " + ibv_port_state_str(attr.state);
  }
  choice->roce = attr.link_layer == IBV_LINK_LAYER_ETHERNET;
  choice->gidIndex = -1;
  if (choice->roce) {
    choice->gidIndex = chooseGid(ctx, choice->port, attr.gid_tbl_len);
    if (choice->gidIndex < 0) return "RoCE port " + std::to_string(choice->port) + " has no GID";
  }
  return "";
}

}  // namespace

DeviceChoice chooseDevice() {
  DeviceList devices;
  if (!devices.list || devices.n == 0) {
    throw std::runtime_error(devices.list ? "no verbs device on this host"
                                          : std::string("ibv_get_device_list failed: ") +
                                                strerror(errno));
  }
  std::string wanted;
  int wantedPort = 1;
  const bool forced = requestedDevice(&wanted, &wantedPort);
  std::string reasons;
  for (int i = 0; i < devices.n; ++i) {
    std::string name = ibv_get_device_name(devices.list[i]);
    if (forced && name != wanted) continue;
    ibv_context* ctx = ibv_open_device(devices.list[i]);
    if (!ctx) {
      reasons += (reasons.empty() ? "" : "; ") + name + ": cannot open (" + strerror(errno) + ")";
      continue;
    }
    Owned<ibv_context> owned(ctx);
    ibv_device_attr dattr;
    int ports = ibv_query_device(ctx, &dattr) ? 1 : dattr.phys_port_cnt;
    for (int p = forced ? wantedPort : 1; p <= (forced ? wantedPort : ports); ++p) {
      DeviceChoice choice;
      choice.name = name;
      choice.port = p;
      std::string why = describePort(ctx, &choice);
      if (why.empty()) return choice;
      reasons += (reasons.empty() ? "" : "; ") + name + ": " + why;
    }
  }
  if (forced && reasons.empty()) {
    std::string have;
    for (int i = 0; i < devices.n; ++i) {
      have += (i ? ", " : "") + std::string(ibv_get_device_name(devices.list[i]));
    }
    throw std::runtime_error("DICOMM_IB_DEVICE names '" + wanted +
                             "', which this host does not have (devices: " + have + ")");
  }
  throw std::runtime_error("no verbs device with an active port (" + reasons + ")");
}

std::string unusableReason() {
  try {
    openDevice(chooseDevice());
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

Owned<ibv_context> openDevice(const DeviceChoice& choice) {
  DeviceList devices;
  for (int i = 0; devices.list && i < devices.n; ++i) {
    if (choice.name == ibv_get_device_name(devices.list[i])) {
      ibv_context* ctx = ibv_open_device(devices.list[i]);
      if (!ctx) {
        throw std::runtime_error("cannot open verbs device " + choice.name + ": " +
                                 strerror(errno));
      }
      return Owned<ibv_context>(ctx);
    }
  }
  throw std::runtime_error("verbs device " + choice.name + " disappeared");
}

std::string wcError(const char* op, const char* direction, int peer, const ibv_wc& wc) {
  char vendor[32];
  snprintf(vendor, sizeof(vendor), "0x%x", wc.vendor_err);
  std::string text = std::string("rdma: ") + op + " " + direction + " rank " +
                     std::to_string(peer) + " failed: " + ibv_wc_status_str(wc.status) +
                     " (wc status " + std::to_string(static_cast<int>(wc.status)) +
                     ", vendor error " + vendor + ")";
  if (wc.status == IBV_WC_RETRY_EXC_ERR || wc.status == IBV_WC_RNR_RETRY_EXC_ERR) {
    text += "; the peer stopped answering (did that process exit or crash?)";
  }
  return text;
}

std::string callError(const char* op, int peer, int err) {
  return std::string("rdma: ") + op + " for rank " + std::to_string(peer) +
         " failed: " + strerror(err) + " (errno " + std::to_string(err) + ")";
}

}  // namespace rdma
}  // namespace dicomm
