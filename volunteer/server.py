"""A stage server process: one ROUTER socket that clients and other servers reach, the role it
plays in its stage (frontal or backward) and the parameter shard every server holds.

``StageServer`` wires sockets to handlers; the handlers live in ``frontal``, ``backward`` and
``shard``. Messages are dispatched by op, and by whether they come from a client or from a
server of the job: servers connect under the identity ``s:<name>`` and with the servers' key
pair, which only holders of the server token have (``security``).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from dips.curve import tcp_endpoint
from diutil.untrusted import RateLimitedLog

from .backward import BackwardServer
from .frontal import FrontalServer
from .job import Job, flat_parameters
from .roster import Roster
from .security import JobKeys, authenticator, connecting_socket, serving_socket
from .shard import ParameterShard
from .wire import Message, ProtocolError

log = logging.getLogger("volunteer.server")

TICK = 0.02  # seconds between timer passes
PING_MAX_BYTES = 1 << 20
HANDSHAKE_LOG_INTERVAL = 10.0
HEARTBEAT_SUFFIX = b":hb"
FORGET_AFTER = 600.0  # a client silent this long leaves the roster (a restarted one joins anew)


def max_message_bytes(job: Job) -> int:
    """The largest frame a job's sockets accept: a stage's whole parameter vector, or a whole
    micro-batch of activations, plus room for the header."""
    params = max(job.stage_parameters(k) for k in range(len(job.stages)))
    rows = job.microbatch_samples * job.seq * max(job.spec.hidden, 2)
    return 4 * max(params, rows) + PING_MAX_BYTES + (64 << 10)


class StageServer:
    """Server ``name`` of ``job``, serving at ``bind`` (default: loopback at the port the job
    gives it). ``run()`` returns once every step is committed and ``linger`` seconds passed."""

    def __init__(self, job: Job, name: str, keys: JobKeys, bind: str | None = None, data: torch.Tensor | None = None,
                 linger: float = 2.0, clock: Callable[[], float] = time.monotonic):
        if keys.peer is None:
            raise ValueError(f"stage server {name}: servers speak to each other with the server token; "
                             "give it --server-token-file")
        self.job, self.name, self.keys, self.clock, self.linger = job, name, keys, clock, linger
        self.stage, self.side, self.index = job.find(name)
        spec = job.stages[self.stage]
        self.shard_index = (spec.frontal + spec.backward).index(next(s for s in spec.servers if s.name == name))
        self.address = next(s.address for s in spec.servers if s.name == name)
        port = self.address.rpartition(":")[2]
        self.bind = bind or f"127.0.0.1:{port}"
        self.max_bytes = max_message_bytes(job)
        self.roster = Roster(job.liveness, clock)
        if data is None and self.stage in (0, len(job.stages) - 1):
            data = job.training_tokens()
        initial = torch.cat([p.detach().reshape(-1) for p in flat_parameters(job.stage_module(self.stage))])
        self.shard = ParameterShard(job, self.stage, self.shard_index, initial, self.roster,
                                    self._to_client, self._to_server, clock)
        if self.side == "frontal":
            self.role = FrontalServer(job, self.stage, self.index, self.roster, self._to_client, self._to_server,
                                      clock, data)
        else:
            self.role = BackwardServer(job, self.stage, self.index, self._to_client, self._to_server)
        self.context = zmq.Context()
        self.auth = authenticator(self.context, keys)
        try:
            self.socket = serving_socket(self.context, keys, tcp_endpoint(self.bind), self.max_bytes)
        except BaseException:  # e.g. the port is taken: leave no authenticator thread behind
            self.auth.stop()
            self.context.term()
            raise
        # handshake failures happen below the application: the monitor is how they get logged
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self._handshake_logged_at, self._handshakes_unlogged = -HANDSHAKE_LOG_INTERVAL, 0
        self._bad = RateLimitedLog(log)  # refusals are logged, but a peer cannot fill the log
        self.peers: dict[str, zmq.Socket] = {}
        self.stop_event = threading.Event()
        self.refused = 0
        self._local: collections.deque[Message] = collections.deque()
        self._handlers = self._dispatch_table()

    # -- delivery ------------------------------------------------------------------------------
    def _to_client(self, identity: bytes, msg: Message) -> None:
        self.socket.send_multipart([identity, *msg.encode()], copy=False)

    def _to_server(self, name: str, msg: Message) -> None:
        if name == self.name:  # its own role and shard: handled after the current message
            self._local.append(msg)
            return
        sock = self.peers.get(name)
        if sock is None:
            address = next(s.address for st in self.job.stages for s in st.servers if s.name == name)
            sock = self.peers[name] = connecting_socket(self.context, self.keys, tcp_endpoint(address),
                                                        f"s:{self.name}".encode(), self.max_bytes, as_server=True)
        sock.send_multipart(msg.encode(), copy=False)

    # -- dispatch ------------------------------------------------------------------------------
    def _dispatch_table(self) -> dict[tuple[str, str], Callable]:
        """(sender kind, op) -> handler(sender identity, message)."""
        role, shard = self.role, self.shard
        table: dict[tuple[str, str], Callable] = {
            ("client", "JOIN"): lambda c, m: self._to_client(c, Message("JOB", {"job": self.job.to_dict()})),
            ("client", "PING"): self._on_ping,
            ("client", "HELLO"): lambda c, m: self.roster.hello(c, m.float("flops")),
            ("client", "LEAVE"): lambda c, m: self.roster.leave(c),
            ("client", "PUSH"): shard.on_push,
            ("client", "PULL"): shard.on_pull,
            ("server", "SEG_DONE"): lambda s, m: shard.on_segment_done(m),
            ("server", "COMMITTED"): lambda s, m: role.on_committed(m),
        }
        if isinstance(role, FrontalServer):
            table.update({
                ("client", "REQ_TASK"): role.on_request,
                ("client", "FWD_DONE"): role.on_forward_done,
                ("client", "BWD_DONE"): role.on_backward_done,
                ("server", "ACT_FWD"): lambda s, m: role.on_activations(m),
                ("server", "GRAD_READY"): lambda s, m: role.on_gradient_ready(m),
                ("server", "REDO"): lambda s, m: role.on_redo(m),
                ("server", "LOSS"): lambda s, m: role.on_loss_part(m),
            })
        else:
            table.update({
                ("client", "ACT"): role.on_activations,
                ("client", "GET_GRAD"): role.on_get_gradient,
                ("server", "GRAD"): lambda s, m: role.on_gradient(m),
            })
        return table

    def _sender_kind(self, identity: bytes, user_id: str | None) -> str:
        """"server" for a connection that authenticated with the servers' key under the name of
        one of the job's servers; "client" for every other."""
        if identity.startswith(b"s:"):
            name = identity[2:].decode(errors="replace")
            if not self.keys.is_peer(user_id):
                raise ProtocolError(f"a connection calls itself server {name[:64]!r} without the servers' key")
            if any(s.name == name for st in self.job.stages for s in st.servers):
                return "server"
            raise ProtocolError(f"server {name[:64]!r} is not one of this job's")
        return "client"

    def _on_ping(self, client: bytes, msg: Message) -> None:
        payload = msg.tensors[0] if msg.tensors else torch.empty(0)
        if payload.numel() * payload.element_size() > PING_MAX_BYTES:
            raise ProtocolError(f"PING payload of {payload.numel() * payload.element_size()} bytes; at most {PING_MAX_BYTES}")
        self._to_client(client, Message("PONG", {}, [payload]))

    def _handle(self, identity: bytes, msg: Message, user_id: str | None = None) -> None:
        if identity.endswith(HEARTBEAT_SUFFIX):  # a client's heartbeat socket: beats only
            if msg.op != "HEARTBEAT":
                raise ProtocolError(f"{msg.op} from a heartbeat connection")
            self.roster.heard(identity[: -len(HEARTBEAT_SUFFIX)])
            return
        kind = self._sender_kind(identity, user_id)
        handler = self._handlers.get((kind, msg.op))
        if handler is None:
            raise ProtocolError(f"no {msg.op!r} is expected from a {kind} by a {self.side} server")
        if kind == "client":
            if msg.op not in ("JOIN", "PING", "HELLO") and not self.roster.known(identity):
                raise ProtocolError(f"{msg.op} from a client that has not said hello")
            self.roster.heard(identity)
        handler(identity, msg)

    def _receive(self) -> None:
        frames = self.socket.recv_multipart(copy=False)
        identity, body = frames[0].bytes, frames[1:]
        try:
            user_id = body[0].get("User-Id") if body else None
            self._handle(identity, Message.decode([f.bytes for f in body]), user_id)
        except ProtocolError as exc:
            self.refused += 1
            self._bad.warning("%s refused a message from %s: %s", self.name, identity.decode(errors="replace")[:64], exc)
        except Exception:  # a bug, not the peer's input (that is a ProtocolError): keep serving
            self.refused += 1
            log.exception("%s: handling a message from %s failed", self.name, identity.decode(errors="replace")[:64])
        self._handle_local()

    def _handshake_failed(self) -> None:
        """Log refused connections, at most one line per HANDSHAKE_LOG_INTERVAL: a peer with the
        wrong keys reconnects every few hundred milliseconds."""
        event = recv_monitor_message(self.monitor)
        self.refused += 1
        self._handshakes_unlogged += 1
        now = self.clock()
        if now - self._handshake_logged_at >= HANDSHAKE_LOG_INTERVAL:
            log.warning("%s refused %d connection(s), the last from %s: CURVE handshake failed: the peer does not "
                        "hold the job's keys", self.name, self._handshakes_unlogged,
                        event.get("endpoint", b"?").decode(errors="replace"))
            self._handshake_logged_at, self._handshakes_unlogged = now, 0

    def _handle_local(self) -> None:
        me, key = f"s:{self.name}".encode(), self.keys.peer.public.decode() if self.keys.peer else None
        while self._local:
            self._handle(me, self._local.popleft(), key)

    # -- loop ----------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.role.finished and self.shard.version >= self.job.steps

    def run(self) -> None:
        """Serve until every step is committed (then ``linger`` s more) or ``stop()``."""
        log.info("%s: %s server %d of stage %d on %s", self.name, self.side, self.index, self.stage, self.bind)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        last_tick, finished_at = 0.0, None
        try:
            while not self.stop_event.is_set():
                for _ in range(256):  # drain what came, but never starve the timers
                    ready = dict(poller.poll(0 if _ else TICK * 1000))
                    if not ready:
                        break
                    if self.monitor in ready:
                        self._handshake_failed()
                    if self.socket in ready:
                        self._receive()
                now = self.clock()
                if now - last_tick >= TICK:
                    last_tick = now
                    if isinstance(self.role, FrontalServer):
                        self.role.tick()
                    self.shard.tick()
                    self.roster.forget_departed(FORGET_AFTER)
                    self._handle_local()
                if self.finished:
                    finished_at = finished_at or now
                    if now - finished_at >= self.linger:
                        break
        finally:
            self.close()

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        self.socket.disable_monitor()
        for s in list(self.peers.values()) + [self.monitor, self.socket]:
            s.close(0)
        self.auth.stop()
        self.context.term()
