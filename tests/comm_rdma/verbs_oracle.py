"""An independent verbs peer for DiComm's rdma transport, written on pyverbs (rdma-core's
own bindings), sharing no code with the C++ transport: only the wire format, taken from the
comment and structs at the top of csrc/comm/transport/rdma/RdmaTransport.h.

It is rank 1 of a two-rank `transport_check <transport> 0 2 <port> oracle` run and checks,
from outside DiComm:
  1. DiComm -> oracle, eager (one SEND through a bounce slot) and rendezvous (RTS, the
     oracle answers CTS with its own buffer's address and key, DiComm RDMA-writes into it):
     both land byte for byte, so DiComm registered its send buffer and wrote through the
     key it was given.
  2. oracle -> DiComm, eager, and rendezvous: DiComm answers the oracle's RTS with the address
     and remote key of its posted buffer; the oracle RDMA-writes through them. DiComm then
     checks the bytes (transport_check), so the key it published opens exactly that buffer.
  3. an RDMA READ through that same published key is refused: DiComm registers memory and
     queue pairs for remote write only, so no peer can read a process's memory. This is the
     last step, as a refused request moves both queue pairs to the error state.
Exit code 0 when every check passed; failures print "FAIL: ..." and exit 1.

    verbs_oracle.py --store-port PORT [--device rxe0] [--timeout 120]
    verbs_oracle.py --probe      (can pyverbs be loaded here?)
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import random
import socket
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
KEY_PREFIX = "check/"  # transport_check's TransportContext::keyPrefix
RANK, PEER, WORLD = 1, 0, 2
EAGER_N, LARGE_N = 1000, 1 << 20  # transport_check's oracle mode sizes
EAGER_MAX = 32 << 10  # DICOMM_RDMA_EAGER's default: the largest payload after a header
CONN_MAGIC = 0x31616D6472694444  # "DDirdma1"
EAGER, RTS, CTS, KEEPALIVE, GOODBYE = 1, 2, 3, 4, 5
RECV_SLOTS, SEND_SLOTS = 32, 8
LARGE_ID = 1  # the transfer id of the oracle's own rendezvous


class Envelope(ctypes.Structure):
    _fields_ = [("tag", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("dtype", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


class Ctrl(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_uint32), ("status", ctypes.c_int32), ("envelope", Envelope),
                ("id", ctypes.c_uint64), ("address", ctypes.c_uint64), ("rkey", ctypes.c_uint32),
                ("pad", ctypes.c_uint32)]


class ConnInfo(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_uint64), ("qpn", ctypes.c_uint32), ("psn", ctypes.c_uint32),
                ("lid", ctypes.c_uint16), ("roce", ctypes.c_uint8), ("mtu", ctypes.c_uint8),
                ("gid", ctypes.c_uint8 * 16)]


SLOT = ctypes.sizeof(Ctrl) + EAGER_MAX


class OracleFailure(Exception):
    pass


def pattern(src: int, dst: int, tag: int, n: int) -> bytes:
    """transport_check's byte pattern, computed here independently."""
    i = np.arange(n, dtype=np.uint64)
    return ((src * 131 + dst * 31 + tag * 7 + i * 13 + (i >> 11)) & 0xFF).astype(np.uint8).tobytes()


def load_pyverbs():
    """pyverbs through dicomm/verbs.py's loader, read as a file so that the dicomm package
    (and with it the transport under test) is never imported here."""
    spec = importlib.util.spec_from_file_location("dicomm_verbs_loader", ROOT / "dicomm" / "verbs.py")
    loader = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loader  # dataclasses look their module up there
    spec.loader.exec_module(loader)
    return loader.import_pyverbs()


class Oracle:
    def __init__(self, device: str | None, store, deadline: float):
        load_pyverbs()
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self.e, self.MR, self.store, self.deadline = e, MR, store, deadline
        name = device or get_device_list()[0].name.decode()
        self.ctx = Context(name=name)
        self.port = self.ctx.query_port(1)
        self.roce = int(self.port.link_layer) == e.IBV_LINK_LAYER_ETHERNET
        self.gid_index = self._gid_index()
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 2 * (RECV_SLOTS + SEND_SLOTS) + 16)
        cap = QPCap(max_send_wr=SEND_SLOTS + 8, max_recv_wr=RECV_SLOTS, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        local = e.IBV_ACCESS_LOCAL_WRITE
        self.recv_mr = MR(self.pd, RECV_SLOTS * SLOT, local)
        self.send_mr = MR(self.pd, SEND_SLOTS * SLOT, local)
        self.free_send = list(range(SEND_SLOTS))
        self.psn = random.getrandbits(24)
        self.next_wr = 1
        self.pending: dict[int, str] = {}  # send wr_id -> what it was
        self.slot_of: dict[int, int] = {}  # send wr_id -> the send slot it holds
        self.finished: dict[int, int] = {}  # send wr_id -> completion status
        self.done: dict[str, bool] = {}
        self.cts: Ctrl | None = None  # DiComm's answer to the oracle's rendezvous
        self.their_large: tuple[int, object] | None = None  # (transfer id, the MR it lands in)
        self.write_mr = None
        self.probing = False

    def _gid_index(self) -> int:
        """A RoCE v2 GID mapping an IPv4 address if there is one (what rxe's peers use), else
        the first non-zero GID; 0 on InfiniBand (LIDs route)."""
        if not self.roce:
            return 0
        first = None
        for index in range(min(int(self.port.gid_tbl_len), 16)):
            gid = str(self.ctx.query_gid(1, index))
            if set(gid.replace(":", "")) <= {"0"}:
                continue
            first = index if first is None else first
            if gid.startswith("0000:0000:0000:0000:0000:ffff:"):
                return index
        if first is None:
            raise OracleFailure("the RoCE port has no GID")
        return first

    # ---- connection, through the same store keys as RdmaTransport::connect ------------------

    def _key(self, what: str, frm: int, to: int) -> str:
        return f"{KEY_PREFIX}rdma/{what}/{frm}/{to}"

    def connect(self) -> None:
        from pyverbs.addr import AHAttr, GID, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self.e
        attr = QPAttr(qp_state=e.IBV_QPS_INIT)
        attr.pkey_index, attr.port_num = 0, 1
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        self.qp.modify(attr, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)
        for slot in range(RECV_SLOTS):
            self._post_recv(slot)
        mine = ConnInfo(magic=CONN_MAGIC, qpn=self.qp.qp_num, psn=self.psn, lid=int(self.port.lid),
                        roce=int(self.roce), mtu=int(self.port.active_mtu))
        raw_gid = bytes.fromhex(str(self.ctx.query_gid(1, self.gid_index)).replace(":", ""))
        ctypes.memmove(mine.gid, raw_gid, 16)
        self.store.set(self._key("qp", RANK, PEER), bytes(mine))
        self.store.wait([self._key("qp", PEER, RANK)])
        raw = self.store.get(self._key("qp", PEER, RANK))
        if len(raw) != ctypes.sizeof(ConnInfo):
            raise OracleFailure(f"DiComm published {len(raw)} bytes of queue-pair data, the header "
                                f"says {ctypes.sizeof(ConnInfo)}")
        theirs = ConnInfo.from_buffer_copy(raw)
        if theirs.magic != CONN_MAGIC:
            raise OracleFailure(f"DiComm's queue-pair data has magic {theirs.magic:#x}")
        rtr = QPAttr(qp_state=e.IBV_QPS_RTR)
        rtr.path_mtu = min(int(theirs.mtu), int(self.port.active_mtu))
        rtr.dest_qp_num, rtr.rq_psn = theirs.qpn, theirs.psn
        rtr.max_dest_rd_atomic, rtr.min_rnr_timer = 1, 1
        if self.roce:
            dgid = GID(":".join(bytes(theirs.gid)[i:i + 2].hex() for i in range(0, 16, 2)))
            grh = GlobalRoute(dgid=dgid, sgid_index=self.gid_index, hop_limit=64)
            rtr.ah_attr = AHAttr(port_num=1, is_global=1, gr=grh, dlid=theirs.lid)
        else:
            rtr.ah_attr = AHAttr(port_num=1, dlid=theirs.lid)
        self.qp.modify(rtr, e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN
                       | e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)
        rts = QPAttr(qp_state=e.IBV_QPS_RTS)
        rts.timeout, rts.retry_cnt, rts.rnr_retry, rts.sq_psn, rts.max_rd_atomic = 16, 6, 7, self.psn, 1
        self.qp.modify(rts, e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY
                       | e.IBV_QP_SQ_PSN | e.IBV_QP_MAX_QP_RD_ATOMIC)
        self.store.set(self._key("ready", RANK, PEER), b"\x01")
        self.store.wait([self._key("ready", PEER, RANK)])

    # ---- posting ----------------------------------------------------------------------------

    def _post_recv(self, slot: int) -> None:
        from pyverbs.wr import SGE, RecvWR

        sge = SGE(self.recv_mr.buf + slot * SLOT, SLOT, self.recv_mr.lkey)
        self.qp.post_recv(RecvWR(wr_id=(1 << 63) | slot, num_sge=1, sg=[sge]))

    def _post(self, what: str, opcode: int, sge, rdma: tuple[int, int] | None = None, imm: int = 0) -> int:
        from pyverbs.wr import SendWR

        wr_id, self.next_wr = self.next_wr, self.next_wr + 1
        wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=self.e.IBV_SEND_SIGNALED,
                    imm_data=imm)
        if rdma is not None:
            wr.set_wr_rdma(rdma[1], rdma[0])  # (rkey, remote address)
        self.qp.post_send(wr)
        self.pending[wr_id] = what
        return wr_id

    def send_ctrl(self, ctrl: Ctrl, payload: bytes = b"") -> None:
        from pyverbs.wr import SGE

        if not self.free_send:
            self.progress(until=lambda: bool(self.free_send))
        slot = self.free_send.pop()
        data = bytes(ctrl) + payload
        self.send_mr.write(data, len(data), slot * SLOT)
        wr_id = self._post(f"send kind {ctrl.kind}", self.e.IBV_WR_SEND,
                           SGE(self.send_mr.buf + slot * SLOT, len(data), self.send_mr.lkey))
        self.slot_of[wr_id] = slot

    # ---- the checks -------------------------------------------------------------------------

    def run(self) -> None:
        barrier(self.store, "connected")
        barrier(self.store, "posted")
        # 2. oracle -> DiComm: eager tag 1, then the rendezvous of tag 2.
        self.send_ctrl(Ctrl(kind=EAGER, envelope=Envelope(tag=1, nbytes=EAGER_N, dtype=0)), pattern(RANK, PEER, 1, EAGER_N))
        self.write_mr = self.MR(self.pd, LARGE_N, self.e.IBV_ACCESS_LOCAL_WRITE)
        self.write_mr.write(pattern(RANK, PEER, 2, LARGE_N), LARGE_N, 0)
        self.send_ctrl(Ctrl(kind=RTS, envelope=Envelope(tag=2, nbytes=LARGE_N, dtype=0), id=LARGE_ID))
        wanted = ("eager tag 3 arrived intact", "rendezvous tag 4 arrived intact", "our eager send completed",
                  "our RDMA write through DiComm's key completed")
        self.progress(until=lambda: all(self.done.get(w) for w in wanted))
        barrier(self.store, "verified")  # DiComm checked what the oracle wrote
        self.read_probe()
        barrier(self.store, "finished")

    def read_probe(self) -> None:
        """3. An RDMA READ through the key DiComm published for tag 2 must be refused."""
        from pyverbs.wr import SGE

        probe = self.MR(self.pd, 64, self.e.IBV_ACCESS_LOCAL_WRITE)
        self.probing = True  # a refused request flushes every posted receive: expected now
        wr_id = self._post("read probe", self.e.IBV_WR_RDMA_READ, SGE(probe.buf, 64, probe.lkey),
                           rdma=(self.cts.address, self.cts.rkey))
        status = self.progress(until=lambda: wr_id in self.finished, tolerate={wr_id})[wr_id]
        if status == self.e.IBV_WC_SUCCESS:
            leaked = probe.read(64, 0) == pattern(RANK, PEER, 2, LARGE_N)[:64]
            raise OracleFailure("an RDMA READ through the key DiComm published succeeded: its memory is "
                                f"readable by peers{' (and it returned the buffer bytes)' if leaked else ''}")
        print(f"oracle: RDMA READ through DiComm's key refused as it must be (status {status})", flush=True)

    def progress(self, until, tolerate: set[int] = frozenset()) -> dict[int, int]:
        """Handle completions until `until()`; returns wr_id -> status of finished sends.
        Sleeps between empty polls: the oracle shares cores with the rank it checks."""
        while not until():
            if time.monotonic() > self.deadline:
                raise OracleFailure(f"timed out; done so far: {sorted(k for k, v in self.done.items() if v)}")
            n, wcs = self.cq.poll(16)
            if n == 0:
                time.sleep(0.001)
                continue
            for wc in wcs[:n]:
                self.handle(wc, tolerate)
        return self.finished

    def handle(self, wc, tolerate) -> None:
        e = self.e
        if wc.wr_id & (1 << 63):
            slot = wc.wr_id & ~(1 << 63)
            if wc.status == e.IBV_WC_WR_FLUSH_ERR and self.probing:
                return
            if wc.status != e.IBV_WC_SUCCESS:
                raise OracleFailure(f"a receive failed with status {wc.status}")
            if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                self.rendezvous_landed(socket.ntohl(wc.imm_data))
            else:
                self.message(self.recv_mr.read(wc.byte_len, slot * SLOT))
            self._post_recv(slot)
            return
        what = self.pending.pop(wc.wr_id, "?")
        self.finished[wc.wr_id] = wc.status
        if wc.wr_id in self.slot_of:
            self.free_send.append(self.slot_of.pop(wc.wr_id))
        if wc.status != e.IBV_WC_SUCCESS and wc.wr_id not in tolerate:
            if what == "rdma write":
                raise OracleFailure(f"the RDMA write through the address and key DiComm published for its posted "
                                    f"buffer was refused (status {wc.status}): the published key is wrong")
            raise OracleFailure(f"{what} failed with status {wc.status}")
        if what == "send kind 1":
            self.done["our eager send completed"] = True
        elif what == "rdma write":
            self.done["our RDMA write through DiComm's key completed"] = True

    def message(self, data: bytes) -> None:
        header = ctypes.sizeof(Ctrl)
        if len(data) < header:
            raise OracleFailure(f"DiComm sent a {len(data)}-byte message, shorter than its header")
        c = Ctrl.from_buffer_copy(data[:header])
        env = c.envelope
        if c.kind == EAGER:
            if env.tag != 3 or env.nbytes != EAGER_N or len(data) - header != EAGER_N:
                raise OracleFailure(f"eager message tag {env.tag} of {env.nbytes} bytes in {len(data)}; "
                                    f"expected tag 3, {EAGER_N} bytes after a {header}-byte header")
            if data[header:] != pattern(PEER, RANK, 3, EAGER_N):
                raise OracleFailure("DiComm's eager payload differs from the pattern it was given")
            self.done["eager tag 3 arrived intact"] = True
        elif c.kind == RTS:
            if env.tag != 4 or env.nbytes != LARGE_N:
                raise OracleFailure(f"rendezvous for tag {env.tag} of {env.nbytes} bytes; expected tag 4, {LARGE_N}")
            landing = self.MR(self.pd, LARGE_N, self.e.IBV_ACCESS_LOCAL_WRITE | self.e.IBV_ACCESS_REMOTE_WRITE)
            landing.write(bytes(LARGE_N), LARGE_N, 0)
            self.their_large = (c.id, landing)
            self.send_ctrl(Ctrl(kind=CTS, status=0, envelope=env, id=c.id, address=landing.buf, rkey=landing.rkey))
        elif c.kind == CTS:
            if c.id != LARGE_ID or c.status != 0 or env.nbytes != LARGE_N:
                raise OracleFailure(f"CTS for transfer {c.id}, status {c.status}, {env.nbytes} bytes; expected "
                                    f"transfer {LARGE_ID}, status 0, {LARGE_N} bytes")
            self.cts = c
            from pyverbs.wr import SGE

            self._post("rdma write", self.e.IBV_WR_RDMA_WRITE_WITH_IMM,
                       SGE(self.write_mr.buf, LARGE_N, self.write_mr.lkey),
                       rdma=(c.address, c.rkey), imm=socket.htonl(LARGE_ID))
        elif c.kind in (KEEPALIVE, GOODBYE):
            pass
        else:
            raise OracleFailure(f"DiComm sent a message of unknown kind {c.kind}")

    def rendezvous_landed(self, transfer: int) -> None:
        if self.their_large is None or transfer != self.their_large[0]:
            raise OracleFailure(f"DiComm wrote transfer {transfer}, which the oracle never answered")
        if self.their_large[1].read(LARGE_N, 0) != pattern(PEER, RANK, 4, LARGE_N):
            raise OracleFailure("DiComm's RDMA write of tag 4 left bytes that differ from the pattern")
        self.done["rendezvous tag 4 arrived intact"] = True


def barrier(store, name: str) -> None:
    """transport_check's barrier: count to the world size, then wait for the others."""
    key = f"barrier/{name}"
    store.add(key, 1)
    until = time.monotonic() + 300
    while store.add(key, 0) < WORLD:
        if time.monotonic() > until:
            raise OracleFailure(f"barrier {name} timed out")
        time.sleep(0.01)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store-port", type=int)
    ap.add_argument("--probe", action="store_true", help="only load pyverbs: exit 0, or 1 saying why not")
    ap.add_argument("--device", default=None, help="verbs device (default: the first)")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args(argv)
    if args.probe:
        try:
            load_pyverbs()
        except Exception as exc:  # noqa: BLE001 - say why, in one line
            print(f"{type(exc).__name__}: {exc}")
            return 1
        return 0
    if args.store_port is None:
        ap.error("--store-port is required")
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", args.store_port, world_size=WORLD, is_master=False,
                     timeout=datetime.timedelta(seconds=args.timeout))
    try:
        oracle = Oracle(args.device, store, time.monotonic() + args.timeout)
        oracle.connect()
        oracle.run()
    except OracleFailure as exc:
        print(f"FAIL: {exc}", flush=True)
        return 1
    print("oracle: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
