"""How trajproxy is served: the sockets it listens on, the server in front of the app (`Front`: uvicorn's here,
granian's in proxy/granian_front.py; `Settings.server` chooses), and the log filter that keeps episode keys out of
every line a server writes.

Agents may carry their episode key in the URL (`/e/<key>/v1`), so no path may reach a log line whole. Access logs
are off, and the handshake lines uvicorn's WebSocket code writes (with the path) go through KeyRedactor.
WebSocket serves one route, the trainer's stream (`/api/turns/stream`); the app answers an upgrade anywhere else
at once with 426, so clients that probe a WebSocket transport (the Codex CLI) fall back to plain HTTP.
"""

from __future__ import annotations

import gc
import logging
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from proxy.settings import Settings

# Thousands of agents may connect in one burst at the start of a run; a short accept queue turns the overflow into
# SYN retries, a second or more each. The kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 16384
# How long an idle keep-alive connection is kept open: longer than an agent's think time between calls, so its SDK's
# pooled connection is still there for the next one.
KEEP_ALIVE_S = 75

# A server's WebSocket settings, in one place for every server that fronts the app (uvicorn's names; granian reads
# "ws" to turn its own on, and has no settings for the rest: its limits are tungstenite's, 16 MiB a frame). With wsproto
# the app refuses a handshake with an HTTP status of its own (426, 401) and uvicorn logs no error for it (its
# websockets protocols call every such refusal "returned without completing handshake").
WEBSOCKET: dict[str, Any] = {
    "ws": "wsproto",
    "ws_max_size": 32 * 2**20,  # a batch of replies with token ids and logprobs: the default body limit
    "ws_ping_interval": 20.0,  # a dead trainer's socket is closed, and its leased turns go back, within ~40 s
    "ws_ping_timeout": 20.0,
}

_KEY_IN_PATH = re.compile(r"/e/[^/\s\"']+")
_KEY_IN_QUERY = re.compile(r"([?&]key=)[^&\s\"']+")  # the Gemini API's ?key=
# What uvicorn says of each upgrade request it leaves to the app (which answers it): noise, and with ws="none"
# its advice to install a WebSocket library is wrong for us.
_UPGRADE_NOISE = ("Unsupported upgrade request.", "No supported WebSocket library detected")
# The websockets library, at debug level, writes each handshake header as a line of its own: these carry secrets.
_HEADER_LINES = ("< %s: %s", "> %s: %s")
_SECRET_HEADERS = frozenset({"authorization", "x-api-key", "cookie", "proxy-authorization"})


class KeyRedactor(logging.Filter):
    """Rewrites `/e/<key>` in a record to `/e/<key>` literally (and `?key=<key>` likewise), hides the values of
    headers that carry secrets, and drops uvicorn's notes on upgrade requests."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_UPGRADE_NOISE):
            return False
        record.msg = _redact(record.msg)
        if record.msg in _HEADER_LINES and isinstance(record.args, tuple) and len(record.args) == 2:
            name, _ = record.args
            if str(name).lower() in _SECRET_HEADERS:
                record.args = (name, "<redacted>")
        if isinstance(record.args, tuple):  # kept a tuple of the same length: formatters unpack it
            record.args = tuple(_redact(arg) for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {name: _redact(arg) for name, arg in record.args.items()}
        return True


def _redact(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if "/e/" in value:
        value = _KEY_IN_PATH.sub("/e/<key>", value)
    return _KEY_IN_QUERY.sub(r"\1<key>", value) if "key=" in value else value


def install_log_filter(servers: tuple[str, ...] = ("uvicorn", "uvicorn.error", "uvicorn.access")) -> None:
    """Put KeyRedactor on the loggers a server writes to, and on ours (once; calling again is harmless)."""
    for name in (*servers, "trajproxy"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, KeyRedactor) for f in logger.filters):
            logger.addFilter(KeyRedactor())


def uvicorn_config(app: Any, **overrides: Any) -> Any:
    """The uvicorn configuration trajproxy is served with; `overrides` for log level, shutdown grace and so on."""
    import uvicorn

    options: dict[str, Any] = {
        "access_log": False,  # paths may carry episode keys (/e/<key>/...)
        **WEBSOCKET,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "timeout_graceful_shutdown": 5,  # parked calls would otherwise hold Ctrl-C for a whole turn timeout
        "backlog": LISTEN_BACKLOG,  # uvicorn listens again on the sockets it is given, with this backlog
        **overrides,
    }
    config = uvicorn.Config(app, **options)
    install_log_filter()
    return config


class Front(Protocol):
    """A server in front of the app, on sockets already listening: uvicorn's (below) or granian's."""

    @property
    def started(self) -> bool: ...

    def run(self) -> None:
        """Serve until SIGINT or SIGTERM, then shut down (parked calls given `graceful_s`)."""

    async def serve(self) -> None:
        """Serve on the running event loop until `stop()`; no signal handlers (they belong to the program)."""

    def stop(self) -> None:
        """Begin shutting down; safe from any thread."""


# The collector's thresholds while serving. Python's defaults (700, 10, 10) ran a full collection every 2 s or so at
# 64 agents, each up to 135 ms, over everything alive, imports included: 6% of the core and most of the p99
# (benchmarks/RESULTS.md, "The garbage collector"). A turn's objects are freed by reference counting; what the
# collector is for (cycles, such as a failed call's traceback) is still collected, every 50,000 objects' growth.
GC_THRESHOLDS = (50_000, 20, 10)


def settle_collector() -> None:
    """Leave what start-up made (modules, the app) out of every later collection, and collect young objects less
    often. For the `trajproxy serve` process only: an embedded server shares its host's collector."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def front(server: str, app: Any, sockets: list[socket.socket], log_level: str, graceful_s: float = 5.0) -> Front:
    """The front `server` names ("granian" or "uvicorn") for `app` on `sockets`."""
    if server == "granian":
        from proxy.granian_front import GranianFront

        return GranianFront(app, sockets, log_level=log_level, graceful_s=graceful_s)
    return UvicornFront(app, sockets, log_level=log_level, graceful_s=graceful_s)


class UvicornFront:
    def __init__(self, app: Any, sockets: list[socket.socket], log_level: str, graceful_s: float = 5.0) -> None:
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        self._sockets = sockets
        self._config = uvicorn_config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=graceful_s)
        self._server = uvicorn.Server(self._config)
        self._quiet = Quiet(self._config)

    @property
    def started(self) -> bool:
        return bool(self._server.started or self._quiet.started)

    def run(self) -> None:
        self._server.run(sockets=self._sockets)  # re-raises the signal that stopped it, once shut down

    async def serve(self) -> None:
        await self._quiet.serve(sockets=self._sockets)

    def stop(self) -> None:
        self._server.should_exit = self._quiet.should_exit = True


def listen(settings: Settings) -> list[socket.socket]:
    """The TCP socket trainers and agents use, and the Unix socket sandboxes' gates relay to, if any."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    tcp = socket.create_server((settings.host, settings.port), family=family, backlog=LISTEN_BACKLOG)
    # Accepted connections inherit it. uvicorn sets it on each connection itself; granian leaves its WebSocket
    # connections without it, and the trainer's stream then waited out delayed ACKs: 44 ms a turn at one agent.
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sockets = [tcp]
    if settings.socket_path:
        path = Path(settings.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(str(path))
        unix.listen(LISTEN_BACKLOG)
        sockets.append(unix)
    return sockets
