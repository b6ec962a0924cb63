"""ZeroMQ's own security for the volunteer layer: CURVE (authenticated, encrypted) with a ZAP
handler, keys derived from the job token.

Every process of a job holds the job token (``--token-file``). From it each derives two CURVE
key pairs: the servers' and the clients'. A server accepts a connection only from the client
public key (ZAP refuses any other and logs it); a client talks only to a peer that proves it
holds the server secret key (the CURVE handshake). So the token itself never crosses the wire,
traffic is encrypted, and a device without the token cannot join. Servers also connect to each
other with the client key pair: all holders of the token are equally trusted, as in the
paper's volunteer setting (no Byzantine clients). ``MAXMSGSIZE`` bounds every frame a socket
reads, so an oversize message drops the connection before it is buffered.
"""
from __future__ import annotations

import hashlib
import logging

import zmq
import zmq.auth.thread
from zmq.utils import z85

from dips.auth import JobToken

log = logging.getLogger("volunteer.security")

ZAP_DOMAIN = "ditorch-volunteer"


def _keypair(token: JobToken, role: str) -> tuple[bytes, bytes]:
    secret = z85.encode(hashlib.sha256(f"ditorch-volunteer-{role}\0".encode() + token.secret.encode()).digest())
    return zmq.curve_public(secret), secret


class JobKeys:
    """The job's server and client CURVE key pairs (z85-encoded)."""

    def __init__(self, token: JobToken):
        self.server_public, self.server_secret = _keypair(token, "server")
        self.client_public, self.client_secret = _keypair(token, "client")


class _ClientKeyCheck:
    def __init__(self, keys: JobKeys):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.keys.client_public
        if not ok:
            log.warning("refused a connection to %s: its CURVE key is not the job's client key", domain)
        return ok


class Authenticator:
    """The ZAP handler of one ZeroMQ context (a thread pyzmq runs): admits the job's client key."""

    def __init__(self, context: zmq.Context, keys: JobKeys):
        self._auth = zmq.auth.thread.ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_ClientKeyCheck(keys))

    def stop(self) -> None:
        self._auth.stop()


def serving_socket(context: zmq.Context, keys: JobKeys, bind: str, max_message_bytes: int) -> zmq.Socket:
    """A ROUTER bound at ``bind`` (``tcp://host:port``) that only job clients can reach."""
    s = context.socket(zmq.ROUTER)
    s.curve_server = True
    s.curve_secretkey, s.curve_publickey = keys.server_secret, keys.server_public
    s.zap_domain = ZAP_DOMAIN.encode()
    _common(s, max_message_bytes)
    s.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a message to a departed client is dropped, not an error
    s.bind(bind)
    return s


def connecting_socket(context: zmq.Context, keys: JobKeys, endpoint: str, identity: bytes,
                      max_message_bytes: int) -> zmq.Socket:
    """A DEALER to the server at ``endpoint`` under ``identity``, as a job client."""
    s = context.socket(zmq.DEALER)
    s.curve_serverkey = keys.server_public
    s.curve_publickey, s.curve_secretkey = keys.client_public, keys.client_secret
    s.identity = identity
    _common(s, max_message_bytes)
    s.connect(endpoint)
    return s


def _common(s: zmq.Socket, max_message_bytes: int) -> None:
    s.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 10000)
    s.setsockopt(zmq.RCVHWM, 10000)
    # a vanished host is noticed by the kernel in seconds rather than never
    s.setsockopt(zmq.TCP_KEEPALIVE, 1)
    s.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
    s.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 2)
    s.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
