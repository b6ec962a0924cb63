"""Control flow: compact JSON messages over gRPC generic handlers (no generated stubs).

Every request carries the job token in field ``tok``; a request without the right token is
refused with PERMISSION_DENIED and logged. Message sizes are tracked: the control flow is meant
to stay under 1 KB per message.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent import futures

import grpc

from .auth import JobToken

log = logging.getLogger("dips.rpc")

CONTROL_LIMIT = 1024


class MessageStats:
    def __init__(self) -> None:
        self.max_bytes = 0
        self.count = 0
        self._lock = threading.Lock()

    def add(self, size: int) -> None:
        with self._lock:
            self.count += 1
            self.max_bytes = max(self.max_bytes, size)


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(data: bytes) -> dict:
    msg = json.loads(data)
    if not isinstance(msg, dict):
        raise ValueError(f"control message must be a JSON object, got {type(msg).__name__}")
    return msg


class RpcServer:
    """A gRPC server exposing ``handlers[name](msg) -> dict`` as ``/<service>/<name>``."""

    def __init__(self, service: str, handlers: dict[str, Callable[[dict], dict]], token: JobToken,
                 bind: str = "127.0.0.1:0", threads: int = 8):
        self.token = token
        self.stats = MessageStats()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads),
                                   options=[("grpc.so_reuseport", 0)])
        methods = {name: grpc.unary_unary_rpc_method_handler(self._wrap(service, name, fn))
                   for name, fn in handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
        host = bind.rsplit(":", 1)[0]
        self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {bind!r}")
        self.address = f"{host}:{self.port}"
        self._server.start()

    def _wrap(self, service: str, name: str, fn: Callable[[dict], dict]):
        def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.stats.add(len(request))
            try:
                msg = decode(request)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")
            if not self.token.verify(msg.pop("tok", None), f"{service}/{name} from {context.peer()}"):
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong or missing job token")
            try:
                reply = encode(fn(msg))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("%s/%s rejected: %s", service, name, exc)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.stats.add(len(reply))
            return reply
        return handler

    def stop(self, grace: float | None = 0) -> None:
        self._server.stop(grace).wait()


class RpcError(RuntimeError):
    """A control call that failed; ``unavailable`` tells a peer that is down from a refusal."""

    def __init__(self, message: str, unavailable: bool):
        super().__init__(message)
        self.unavailable = unavailable


class RpcClient:
    def __init__(self, service: str, address: str, token: JobToken):
        self.service, self.address, self.token = service, address, token
        # short reconnect backoff: a restarted peer must be reachable again within a heartbeat
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500)])
        self._calls: dict[str, Callable] = {}

    def call(self, method: str, /, timeout: float = 5.0, **fields) -> dict:
        fn = self._calls.get(method)
        if fn is None:
            fn = self._calls[method] = self._channel.unary_unary(f"/{self.service}/{method}")
        try:
            reply = fn(encode({"tok": self.token.secret, **fields}), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            unavailable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            raise RpcError(f"{self.service}/{method} at {self.address}: {code.name}: {exc.details()}",
                           unavailable) from None
        return decode(reply)

    def close(self) -> None:
        self._channel.close()
