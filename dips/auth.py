"""The job token: a shared secret every Di-PS message must carry."""
from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger("dips.auth")

MIN_TOKEN_CHARS = 16


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

    def verify(self, presented: str | bytes | None, what: str = "message") -> bool:
        """True when ``presented`` is the token; a refusal is logged (never the token itself)."""
        if isinstance(presented, str):
            presented = presented.encode()
        ok = isinstance(presented, bytes) and hmac.compare_digest(presented, self._bytes)
        if not ok:
            log.warning("refused %s: %s job token", what, "missing" if not presented else "wrong")
        return ok
