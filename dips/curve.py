"""ZeroMQ's own security for the data flows: CURVE (authenticated, encrypted) behind a ZAP handler.

Key pairs are derived from a role's shared secret (a :class:`~dips.auth.JobToken`) and a label,
so every holder of the secret gets the same pair without a key file per process, and the secret
itself never crosses the wire. A serving socket admits only the public keys it was given (the
ZAP handler refuses and logs any other); a connecting socket talks only to a peer that proves it
holds the server secret key (the CURVE handshake). ``MAXMSGSIZE`` bounds every frame a socket
reads, so an oversize message drops the connection before it is buffered.

Used by Di-PS (clusters -> followers) and by the volunteer layer (clients <-> stage servers).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging

import zmq
import zmq.auth.thread
from zmq.utils import z85

from diutil.address import split
from .auth import JobToken

log = logging.getLogger("dips.curve")


@dataclasses.dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, z85-encoded."""

    public: bytes
    secret: bytes

    @classmethod
    def derive(cls, token: JobToken, label: str) -> "KeyPair":
        """The pair every holder of ``token`` derives for ``label`` (one label per role)."""
        secret = z85.encode(hashlib.sha256(f"{label}\0".encode() + token.secret.encode()).digest())
        return cls(zmq.curve_public(secret), secret)


class _KeyCheck:
    def __init__(self, admitted: frozenset[bytes]):
        self.admitted = admitted

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.admitted
        if not ok:
            log.warning("refused a connection to %s: its CURVE key is not one this server admits", domain)
        return ok


class Authenticator:
    """The ZAP handler of one ZeroMQ context (a thread pyzmq runs): admits the given public keys.

    One per context: give each server its own ``zmq.Context`` when several share a process.
    """

    def __init__(self, context: zmq.Context, domain: str, admitted: list[bytes]):
        self._auth = zmq.auth.thread.ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve_callback(domain, credentials_provider=_KeyCheck(frozenset(admitted)))

    def stop(self) -> None:
        self._auth.stop()


def serving_socket(context: zmq.Context, server: KeyPair, domain: str, bind: str,
                   max_message_bytes: int) -> zmq.Socket:
    """A ROUTER bound at ``bind`` (``tcp://host:port``) reachable only by admitted keys."""
    s = context.socket(zmq.ROUTER)
    s.curve_server = True
    s.curve_secretkey, s.curve_publickey = server.secret, server.public
    s.zap_domain = domain.encode()
    _common(s, max_message_bytes)
    s.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a message to a departed peer is dropped, not an error
    try:
        s.bind(bind)
    except zmq.ZMQError:
        s.close(0)  # an open socket would block the context's term() forever
        raise
    return s


def connecting_socket(context: zmq.Context, server_public: bytes, client: KeyPair, endpoint: str,
                      max_message_bytes: int, identity: bytes | None = None) -> zmq.Socket:
    """A DEALER to the server at ``endpoint`` that holds the secret of ``server_public``."""
    s = context.socket(zmq.DEALER)
    s.curve_serverkey = server_public
    s.curve_publickey, s.curve_secretkey = client.public, client.secret
    if identity is not None:
        s.identity = identity
    _common(s, max_message_bytes)
    s.connect(endpoint)
    return s


def tcp_endpoint(address: str) -> str:
    """``tcp://host:port`` for ``host:port`` (an IPv6 host in brackets or not)."""
    host, port = split(address)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _common(s: zmq.Socket, max_message_bytes: int) -> None:
    s.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 10000)
    s.setsockopt(zmq.RCVHWM, 10000)
    s.setsockopt(zmq.IPV6, 1)  # IPv6 peers too (IPv4 still works on a dual-stack socket)
    # a vanished host is noticed by the kernel in seconds rather than never
    s.setsockopt(zmq.TCP_KEEPALIVE, 1)
    s.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
    s.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 2)
    s.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    # a peer answers a PING only once it has read what was queued before it: behind a whole
    # model's pull on a slow link (1.6 MB at 0.3 Mbit/s is ~45 s) a shorter wait closes a
    # healthy connection and loses the reply in flight
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 120_000)
