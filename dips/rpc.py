"""Control flow: compact JSON messages over gRPC generic handlers (no generated stubs).

Every request carries a role's secret in field ``tok``: each method names the secrets it
accepts (a cluster's job token cannot call what only servers may), and a request without one of
them is refused with PERMISSION_DENIED and logged. gRPC enforces a message size limit in both
directions (control messages are meant to stay under 1 KB; the limit leaves room for a status
listing many clusters). With :class:`Tls` the channel is TLS (``grpc.ssl_server_credentials``):
the secrets and the control flow are then encrypted and the client checks the server's
certificate against the job's CA.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent import futures
from pathlib import Path

import grpc

from diutil import untrusted
from diutil.address import is_loopback, join, split
from diutil.untrusted import BadMessage, RateLimitedLog
from .auth import JobToken

log = logging.getLogger("dips.rpc")

CONTROL_LIMIT = 1024            # the size control messages are meant to stay under
MAX_MESSAGE_BYTES = 256 * 1024  # the size gRPC refuses beyond, either way
MAX_DEPTH = 8                   # the deepest control message (a layout on the wire) nests 4 levels


@dataclasses.dataclass(frozen=True)
class Tls:
    """TLS files of a job: a server presents ``cert``/``key``; a client trusts ``ca``."""

    ca: str
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        for what in ("ca", "cert", "key"):
            path = getattr(self, what)
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"TLS {what} file {path!r} does not exist")
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS needs both a certificate and its key to serve (or neither, to only connect)")

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None:
            raise ValueError("this process serves gRPC: give it a TLS certificate and key")
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=Path(self.ca).read_bytes())


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


def decode(data: bytes, text: bool = True) -> dict:
    """A control message: a JSON object, bounded, finite, its strings Unicode text unless ``text``
    is False (``BadMessage`` otherwise)."""
    return untrusted.json_object(data, "control message", MAX_MESSAGE_BYTES, max_depth=MAX_DEPTH, text=text)


_LIMITS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
           ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class RpcServer:
    """A gRPC server exposing ``handlers[name](msg) -> dict`` as ``/<service>/<name>``.

    ``access[name]``: the secrets a request to ``name`` may carry (one per role allowed). The
    server is gRPC's asyncio one on a thread of its own: a plain handler runs on one of
    ``threads`` worker threads, while a *wait* handler (``waits[name]``, a coroutine function) is
    awaited on the event loop and holds no thread however long it waits, so many clients waiting
    for a round cannot starve the others' heartbeats. A wait handler sleeps in :meth:`changed`,
    woken by :meth:`notify` from any thread.
    """

    def __init__(self, service: str, handlers: dict[str, Callable[[dict], dict]],
                 access: dict[str, Sequence[JobToken]], bind: str = "127.0.0.1:0", threads: int = 8,
                 tls: Tls | None = None, waits: dict[str, Callable[[dict], Awaitable[dict]]] | None = None):
        waits = waits or {}
        missing = (set(handlers) | set(waits)) - set(access)
        if missing:
            raise ValueError(f"{service}: methods {sorted(missing)} have no access rule")
        self.stats = MessageStats()
        self._refusals = RateLimitedLog(log)  # logged, but a peer repeating them cannot fill the log
        self._pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"{service}-rpc")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name=f"{service}-grpc")
        self._thread.start()
        methods = {name: self._wrap(service, name, self._on_pool(fn), tuple(access[name]))
                   for name, fn in handlers.items()}
        methods.update({name: self._wrap(service, name, fn, tuple(access[name])) for name, fn in waits.items()})
        self.port = asyncio.run_coroutine_threadsafe(self._start(service, methods, bind, tls), self._loop).result()
        if self.port == 0:
            self.stop()
            raise OSError(f"cannot bind gRPC server to {bind!r}")
        self.address = join(split(bind)[0], self.port)
        if tls is None and not is_loopback(split(bind)[0]):
            log.warning("%s listens on %s without TLS: tokens and control messages cross the network in the "
                        "clear (give it --tls-cert/--tls-key; docs/dips.md, Security)", service, self.address)

    async def _start(self, service: str, methods: dict, bind: str, tls: Tls | None) -> int:
        self._changed = asyncio.Event()
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *_LIMITS])
        handlers = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        port = self._server.add_secure_port(bind, tls.server_credentials()) if tls else self._server.add_insecure_port(bind)
        if port:
            await self._server.start()
        return port

    def _on_pool(self, fn: Callable[[dict], dict]) -> Callable[[dict], Awaitable[dict]]:
        async def run(msg: dict) -> dict:
            return await self._loop.run_in_executor(self._pool, fn, msg)
        return run

    def _wrap(self, service: str, name: str, fn: Callable[[dict], Awaitable[dict]], tokens: tuple[JobToken, ...]):
        async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.stats.add(len(request))
            try:  # the token is checked before the text: a malformed token is refused as any wrong one
                msg = decode(request, text=False)
            except BadMessage as exc:  # not logged: anyone who reaches the port could fill the log
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")
            presented = msg.pop("tok", None)
            if not any(t.matches(presented) for t in tokens):
                self._refusals.warning("%s", JobToken.refusal(presented, f"{service}/{name} from {context.peer()}"))
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong or missing token for this method")
            try:
                untrusted.check_text(msg, "control message")
            except BadMessage as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")
            code, why = None, ""
            try:
                reply = encode(await fn(msg))
            except PermissionError as exc:
                code, why = grpc.StatusCode.PERMISSION_DENIED, str(exc)
            except (ValueError, KeyError, TypeError, OverflowError) as exc:
                code, why = grpc.StatusCode.INVALID_ARGUMENT, _reason(exc)
            except Exception as exc:  # a bug, not the caller's input: say so, keep serving
                log.exception("%s/%s failed", service, name)
                code, why = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            if code is not None:
                self._refusals.warning("%s/%s refused: %s", service, name, why[:300])
                await context.abort(code, why[:1000])
            self.stats.add(len(reply))
            return reply
        return handler

    def notify(self) -> None:
        """Wake every wait handler sleeping in :meth:`changed` (callable from any thread)."""
        self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout: float) -> None:
        """Sleep (on the event loop) until :meth:`notify` or ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def stop(self, grace: float | None = 0) -> None:
        if hasattr(self, "_server"):
            asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reason(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"field {exc.args[0]!r} is missing" if exc.args else "a field is missing"
    return str(exc)


class RpcError(RuntimeError):
    """A control call that failed; ``unavailable`` tells a peer that is down from a refusal."""

    def __init__(self, message: str, unavailable: bool, code: str = ""):
        super().__init__(message)
        self.unavailable, self.code = unavailable, code  # code: the gRPC status name


class RpcClient:
    def __init__(self, service: str, address: str, token: JobToken, tls: Tls | None = None):
        self.service, self.address, self.token = service, address, token
        # short reconnect backoff: a restarted peer must be reachable again within a heartbeat.
        # Subchannels of this channel's own: gRPC shares them per address across a process's
        # channels, so a new client of a server now listening on an address where another one
        # stopped would inherit the old subchannel's backoff and fail at once, "connection refused".
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500), ("grpc.use_local_subchannel_pool", 1), *_LIMITS]
        self._channel = (grpc.secure_channel(address, tls.channel_credentials(), options=options) if tls
                         else grpc.insecure_channel(address, options=options))
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
                           unavailable, code.name) from None
        return decode(reply)

    def close(self) -> None:
        self._channel.close()
