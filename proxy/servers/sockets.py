"""The sockets trajproxy listens on, and the connection settings every front applies to them."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from proxy.servers.limits import raise_open_files_limit
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


def listen(settings: Settings) -> list[socket.socket]:
    """The TCP socket trainers and agents use, and the Unix socket sandboxes' gates relay to, if any (the process's
    open-files limit raised first: every connection takes a descriptor)."""
    raise_open_files_limit()
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
