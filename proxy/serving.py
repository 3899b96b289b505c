"""How uvicorn serves trajproxy: one configuration for `trajproxy serve`, the embedded proxy and the tests, and
the log filter that keeps episode keys out of every line uvicorn writes.

Agents may carry their episode key in the URL (`/e/<key>/v1`), so no path may reach a log line whole. The access
log is off, and the handshake lines uvicorn's WebSocket code writes (with the path) go through KeyRedactor.
WebSocket serves one route, the trainer's stream (`/api/turns/stream`); the app answers an upgrade anywhere else
at once with 426, so clients that probe a WebSocket transport (the Codex CLI) fall back to plain HTTP.
"""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proxy.settings import Settings

# Thousands of agents may connect in one burst at the start of a run; a short accept queue turns the overflow into
# SYN retries, a second or more each. The kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 16384

# A server's WebSocket settings, in one place for every server that fronts the app (uvicorn's names). With wsproto
# the app refuses a handshake with an HTTP status of its own (426, 401) and uvicorn logs no error for it (its
# websockets protocols call every such refusal "returned without completing handshake").
WEBSOCKET: dict[str, Any] = {
    "ws": "wsproto",
    "ws_max_size": 32 * 2**20,  # a batch of replies with token ids and logprobs: the default body limit
    "ws_ping_interval": 20.0,  # a dead trainer's socket is closed, and its leased turns go back, within ~40 s
    "ws_ping_timeout": 20.0,
}

_KEY_IN_PATH = re.compile(r"/e/[^/\s\"']+")
# What uvicorn says of each upgrade request it leaves to the app (which answers it): noise, and with ws="none"
# its advice to install a WebSocket library is wrong for us.
_UPGRADE_NOISE = ("Unsupported upgrade request.", "No supported WebSocket library detected")
# The websockets library, at debug level, writes each handshake header as a line of its own: these carry secrets.
_HEADER_LINES = ("< %s: %s", "> %s: %s")
_SECRET_HEADERS = frozenset({"authorization", "x-api-key", "cookie", "proxy-authorization"})


class KeyRedactor(logging.Filter):
    """Rewrites `/e/<key>` in a record to `/e/<key>` literally, hides the values of headers that carry secrets, and
    drops uvicorn's notes on upgrade requests."""

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
    return _KEY_IN_PATH.sub("/e/<key>", value) if isinstance(value, str) and "/e/" in value else value


def install_log_filter() -> None:
    """Put KeyRedactor on every logger uvicorn writes to and on its handlers (once; calling again is harmless)."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "trajproxy"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, KeyRedactor) for f in logger.filters):
            logger.addFilter(KeyRedactor())


def uvicorn_config(app: Any, **overrides: Any) -> Any:
    """The uvicorn configuration trajproxy is served with; `overrides` for log level, shutdown grace and so on."""
    import uvicorn

    options: dict[str, Any] = {
        "access_log": False,  # paths may carry episode keys (/e/<key>/...)
        **WEBSOCKET,
        "timeout_keep_alive": 75,
        "timeout_graceful_shutdown": 5,  # parked calls would otherwise hold Ctrl-C for a whole turn timeout
        "backlog": LISTEN_BACKLOG,  # uvicorn listens again on the sockets it is given, with this backlog
        **overrides,
    }
    config = uvicorn.Config(app, **options)
    install_log_filter()
    return config


def listen(settings: Settings) -> list[socket.socket]:
    """The TCP socket trainers and agents use, and the Unix socket sandboxes' gates relay to, if any."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sockets = [socket.create_server((settings.host, settings.port), family=family, backlog=LISTEN_BACKLOG)]
    if settings.socket_path:
        path = Path(settings.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(str(path))
        unix.listen(LISTEN_BACKLOG)
        sockets.append(unix)
    return sockets
