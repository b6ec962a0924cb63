"""The volunteer layer's keys: two CURVE key pairs derived from the one job token.

Every process of a job holds the job token (``--token-file``) and derives from it the servers'
and the clients' key pairs (:mod:`dips.curve` does the CURVE/ZAP work). A server admits only the
client public key; a client talks only to a peer that proves it holds the server secret key.
Servers also connect to each other with the client pair: all holders of the token are equally
trusted, as in the paper's volunteer setting (no Byzantine clients).
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
    """The job's server and client CURVE key pairs."""

    def __init__(self, token: JobToken):
        self.server = KeyPair.derive(token, "ditorch-volunteer-server")
        self.client = KeyPair.derive(token, "ditorch-volunteer-client")


def authenticator(context: zmq.Context, keys: JobKeys) -> _Authenticator:
    """The ZAP handler of a server's context: admits the job's client key."""
    return _Authenticator(context, ZAP_DOMAIN, [keys.client.public])


def serving_socket(context: zmq.Context, keys: JobKeys, bind: str, max_message_bytes: int) -> zmq.Socket:
    """A ROUTER bound at ``bind`` (``tcp://host:port``) that only job clients can reach."""
    return _serving_socket(context, keys.server, ZAP_DOMAIN, bind, max_message_bytes)


def connecting_socket(context: zmq.Context, keys: JobKeys, endpoint: str, identity: bytes,
                      max_message_bytes: int) -> zmq.Socket:
    """A DEALER to the server at ``endpoint`` under ``identity``, as a job client."""
    return _connecting_socket(context, keys.server.public, keys.client, endpoint, max_message_bytes, identity)
