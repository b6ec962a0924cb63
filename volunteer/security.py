"""The volunteer layer's keys: CURVE key pairs derived from the job's two secrets.

Every process of a job holds the job token (``--token-file``) and derives from it the servers'
and the clients' key pairs (:mod:`dips.curve` does the CURVE/ZAP work). A server admits the
client public key; a client talks only to a peer that proves it holds the server secret key.
Servers alone also hold the server token (``--server-token-file``), from which they derive the
pair they connect to each other with: a message is a server's only when its connection
authenticated with that pair (the ZAP User-Id), whatever identity the peer chose, so a client
cannot pass for a server by naming itself ``s:<server>``.
"""
from __future__ import annotations

import zmq

from dips.auth import JobToken
from dips.curve import Authenticator as _Authenticator
from dips.curve import KeyPair
from dips.curve import connecting_socket as _connecting_socket
from dips.curve import serving_socket as _serving_socket

ZAP_DOMAIN = "ditorch-volunteer"


class JobKeys:
    """The job's server and client CURVE key pairs; with ``server_token`` (servers only) also
    the pair servers speak to each other with."""

    def __init__(self, token: JobToken, server_token: JobToken | None = None):
        self.server = KeyPair.derive(token, "ditorch-volunteer-server")
        self.client = KeyPair.derive(token, "ditorch-volunteer-client")
        self.peer = KeyPair.derive(server_token, "ditorch-volunteer-peer") if server_token is not None else None

    def is_peer(self, user_id: str | None) -> bool:
        """Whether a connection's ZAP User-Id (the z85 public key it authenticated with) is the
        servers' pair."""
        return self.peer is not None and user_id == self.peer.public.decode()


def authenticator(context: zmq.Context, keys: JobKeys) -> _Authenticator:
    """The ZAP handler of a server's context: admits the job's client key and the servers' key."""
    return _Authenticator(context, ZAP_DOMAIN, [keys.client.public] + ([keys.peer.public] if keys.peer else []))


def serving_socket(context: zmq.Context, keys: JobKeys, bind: str, max_message_bytes: int) -> zmq.Socket:
    """A ROUTER bound at ``bind`` (``tcp://host:port``) that only job clients can reach."""
    return _serving_socket(context, keys.server, ZAP_DOMAIN, bind, max_message_bytes)


def connecting_socket(context: zmq.Context, keys: JobKeys, endpoint: str, identity: bytes,
                      max_message_bytes: int, as_server: bool = False) -> zmq.Socket:
    """A DEALER to the server at ``endpoint`` under ``identity``, as a job client (or, with
    ``as_server``, as one of the job's servers)."""
    if as_server and keys.peer is None:
        raise ValueError("a server connects to its peers with the server token: give it --server-token-file")
    mine = keys.peer if as_server else keys.client
    return _connecting_socket(context, keys.server.public, mine, endpoint, max_message_bytes, identity)
