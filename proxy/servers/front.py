"""How trajproxy is served: the sockets it listens on, the server in front of the app (`Front`: uvicorn's here,
granian's in proxy/servers/granian_front.py; `Settings.server` chooses), and the log filter that keeps episode keys out of
every line a server writes.

Agents may carry their episode key in the URL (`/e/<key>/v1`), so no path may reach a log line whole. Access logs
are off, and the handshake lines uvicorn's WebSocket code writes (with the path) go through KeyRedactor.
WebSocket serves one route, the trainer's stream (`/api/turns/stream`); the app answers an upgrade anywhere else
at once with 426, so clients that probe a WebSocket transport (the Codex CLI) fall back to plain HTTP.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any, Protocol

from proxy.servers.uvicorn_front import UvicornFront

if TYPE_CHECKING:
    pass


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


def front(server: str, app: Any, sockets: list[socket.socket], log_level: str, graceful_s: float = 5.0) -> Front:
    """The front `server` names ("granian" or "uvicorn") for `app` on `sockets`."""
    if server == "granian":
        from proxy.servers.granian_front import GranianFront

        return GranianFront(app, sockets, log_level=log_level, graceful_s=graceful_s)
    return UvicornFront(app, sockets, log_level=log_level, graceful_s=graceful_s)
