"""The server in front of the app: the `Front` interface, and the one `Settings.server` names (uvicorn's, by
default, or granian's).

WebSocket serves one route, the trainer's stream (`/api/turns/stream`); the app answers an upgrade anywhere else
at once with 426, so clients that probe a WebSocket transport (the Codex CLI) fall back to plain HTTP.

Either bounds what the app never sees (`limits.Limits`: connections on the sandboxes' socket, the time and size of a
request's head), believes forwarded headers only from the proxies the settings name, and tells the app as its
shutdown begins (`stopping.Ending`: the trainer's long polls end then).
"""

from __future__ import annotations

import socket
from typing import Any, Protocol

from proxy.servers.granian_front import GranianFront
from proxy.servers.limits import NO_LIMITS, Limits
from proxy.servers.uvicorn_front import UvicornFront


class Front(Protocol):
    """A server in front of the app, on sockets already listening: uvicorn's or granian's."""

    @property
    def started(self) -> bool: ...

    def run(self) -> None:
        """Serve until SIGINT or SIGTERM, then shut down (parked calls given `graceful_s`)."""

    async def serve(self) -> None:
        """Serve on the running event loop until `stop()`, then close the sockets; no signal handlers (they belong
        to the program)."""

    def stop(self) -> None:
        """Begin shutting down; safe from any thread."""


def front(
    server: str,
    app: Any,
    sockets: list[socket.socket],
    log_level: str,
    graceful_s: float = 5.0,
    limits: Limits = NO_LIMITS,
) -> Front:
    """The front `server` names ("granian" or "uvicorn") for `app` on `sockets`, within `limits`."""
    if server == "granian":
        return GranianFront(app, sockets, log_level=log_level, graceful_s=graceful_s, limits=limits)
    return UvicornFront(app, sockets, log_level=log_level, graceful_s=graceful_s, limits=limits)
