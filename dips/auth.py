"""Shared secrets of a Di-PS job, one per role.

A job has two: the *job token* clusters hold, and the *server token* the leader and followers
hold. A cluster's token cannot register a follower or drive a follower's outer step; the
CURVE key pairs of the data flow are derived from them (:mod:`dips.curve`).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger("dips.auth")

MIN_TOKEN_CHARS = 16
# labels of the CURVE key pairs derived from each role's secret (dips.curve.KeyPair.derive)
CLUSTER_KEY_LABEL = "dips-cluster"    # from the job token
FOLLOWER_KEY_LABEL = "dips-follower"  # from the server token


class JobToken:
    """A job's shared secret, read from a file; compares in constant time."""

    def __init__(self, secret: str):
        secret = secret.strip()
        if len(secret) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"job token is {len(secret)} characters long; expected at least {MIN_TOKEN_CHARS}"
            )
        self.secret = secret
        self._bytes = secret.encode()

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "JobToken":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"job token file {str(p)!r} does not exist")
        return cls(p.read_text())

    @staticmethod
    def create(path: str | os.PathLike) -> "JobToken":
        """Write a fresh random token to ``path`` (mode 0600) and return it."""
        secret = secrets.token_hex(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        return JobToken(secret)

    def matches(self, presented: object) -> bool:
        """True when ``presented`` is the token (constant-time compare; no log)."""
        if isinstance(presented, str):
            try:
                presented = presented.encode()
            except UnicodeEncodeError:  # a lone surrogate is no token
                return False
        return isinstance(presented, bytes) and hmac.compare_digest(presented, self._bytes)

    @staticmethod
    def refusal(presented: object, what: str) -> str:
        """The log line for a refused request (it never holds the token presented)."""
        return f"refused {what}: {'missing' if not presented else 'wrong'} token"

    def verify(self, presented: object, what: str = "message") -> bool:
        """True when ``presented`` is the token; a refusal is logged (never the token itself)."""
        ok = self.matches(presented)
        if not ok:
            log.warning("%s", self.refusal(presented, what))
        return ok


def issue_push_id(server_token: JobToken, cluster: str) -> str:
    """A fresh push id the leader signs for ``cluster`` with the server token, so a follower can
    tell an id the leader issued from one a cluster made up (and cannot stage pushes at will)."""
    nonce = secrets.token_hex(6)
    return f"{nonce}-{_push_mac(server_token, nonce, cluster)}"


def push_id_issued(server_token: JobToken, push: str, cluster: object) -> bool:
    """True when ``push`` is an id the leader issued to ``cluster`` (constant-time compare)."""
    nonce, _, mac = push.partition("-")
    return isinstance(cluster, str) and hmac.compare_digest(mac, _push_mac(server_token, nonce, cluster))


def _push_mac(server_token: JobToken, nonce: str, cluster: str) -> str:
    return hmac.new(server_token.secret.encode(), f"push\0{nonce}\0{cluster}".encode(), hashlib.sha256).hexdigest()[:20]
