// Python bindings of dicomm._C (the only file that includes torch/python.h: it is slow to compile).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "comm/backend/ProcessGroupDicomm.hpp"
#include "comm/transport/ListenAddress.h"
#include "comm/transport/Spin.h"
#include "comm/transport/Trace.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "DiComm: the dicomm torch.distributed backend (C++ core)";
  // Registers c10d::Backend / Store with pybind before our subclass refers to them.
  py::module_::import("torch.distributed");

  py::class_<dicomm::ProcessGroupDicomm, c10d::Backend,
             c10::intrusive_ptr<dicomm::ProcessGroupDicomm>>(m, "ProcessGroupDicomm")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       double timeoutSeconds, const std::string& transport,
                       const std::string& listenHost, size_t chunkBytes,
                       bool dipuHostAddressable, bool forceStaging, const std::string& groupName,
                       bool dipuAsynchronous) {
             dicomm::DicommOptions o;
             o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000));
             o.transport = transport;
             o.listenHost = listenHost;
             o.chunkBytes = chunkBytes;
             o.staging.privateUse1HostAddressable = dipuHostAddressable;
             o.staging.forceStaging = forceStaging;
             o.staging.privateUse1Asynchronous = dipuAsynchronous;
             o.groupName = groupName;
             return c10::make_intrusive<dicomm::ProcessGroupDicomm>(store, rank, size, o);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_seconds"),
           py::arg("transport") = "auto", py::arg("listen_host") = "",
           py::arg("chunk_bytes") = 4 << 20, py::arg("dipu_host_addressable") = false,
           py::arg("force_staging") = false, py::arg("group_name") = "", py::arg("dipu_asynchronous") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("transport_of", &dicomm::ProcessGroupDicomm::transportOf, py::arg("peer"),
           "Name of the transport that serves `peer` ('self' for this rank).")
      .def("connections_of", &dicomm::ProcessGroupDicomm::connectionsOf, py::arg("peer"),
           "Connections the pair to `peer` stripes large messages over (0 for this rank).")
      .def("congestion_of", &dicomm::ProcessGroupDicomm::congestionOf, py::arg("peer"),
           "TCP congestion control of the connections to `peer` ('' when not TCP).")
      .def("link_of", &dicomm::ProcessGroupDicomm::linkOf, py::arg("peer"),
           "The emulated link to `peer` (DICOMM_LINKS): class, places, GB/s, us and time scale; '' at host speed.")
      .def_property_readonly("aborted", &dicomm::ProcessGroupDicomm::aborted)
      .def_property_readonly("allreduce_algorithm", &dicomm::ProcessGroupDicomm::allreduceAlgorithm,
                             "How allreduces run: 'ring', 'hierarchical', 'shared', or by size (DICOMM_ALLREDUCE, the hosts).")
      .def_property_readonly("host_segment_members", &dicomm::ProcessGroupDicomm::hostSegmentMembers,
                             "Ranks this rank reduces with through its host's shared segment (empty "
                             "before the first allreduce that connects it, or when there is none).")
      .def_property_readonly("timeout_seconds",
                             [](const dicomm::ProcessGroupDicomm& pg) {
                               return pg.options().timeout.count() / 1000.0;
                             })
      .def_property_readonly("abort_cause", &dicomm::ProcessGroupDicomm::abortCause);

  m.def("transports_built", &dicomm::transportsBuilt,
        "Transports compiled into this module, most preferred first.");
  m.def("transports_usable", &dicomm::transportsUsable,
        "Transports that can run on this machine, most preferred first.");
  m.def(
      "choose_listen_address",
      [](const std::string& explicitHost, const std::string& storeHost) {
        auto a = dicomm::chooseListenAddress(explicitHost, storeHost);
        py::dict d;
        d["host"] = a.host;
        d["interface"] = a.interface;
        d["reason"] = a.reason;
        d["loopback"] = a.loopback;
        return d;
      },
      py::arg("listen_host") = "", py::arg("store_host") = "",
      "Where a rank would listen for tcp peers: {host, interface, reason, loopback}, from "
      "DICOMM_LISTEN_HOST / DICOMM_SOCKET_IFNAME / DICOMM_SOCKET_FAMILY and the store's host.");
  m.def(
      "host_busy",
      [] {
        dicomm::sampleHostLoad(/*callerPolls=*/false);
        return dicomm::hostBusy();
      },
      "Whether waiters on this host block at once instead of polling: more runnable threads "
      "than cores (sampled at most once a ms, averaged; see csrc/comm/transport/Spin.h).");
  m.def(
      "_trace_take",
      [] {
        py::dict d;
        for (auto& [name, ns] : dicomm::trace::take()) d[py::str(name)] = ns;
        return d;
      },
      "DICOMM_TRACE=1: CLOCK_MONOTONIC ns of each point along the latest point-to-point send "
      "and receive (0: not reached since the last call), then cleared (benchmarks/comm.py "
      "--breakdown).");
  m.def("local_host_id", &dicomm::localHostId,
        "What identifies this host for the intra-host (shm) transport.");
}
