"""How uvicorn serves trajproxy: its configuration, and the `Front` that runs it on sockets already listening."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from proxy.servers.redaction import install_log_filter
from proxy.servers.sockets import KEEP_ALIVE_S, LISTEN_BACKLOG, WEBSOCKET


def uvicorn_config(app: Any, **overrides: Any) -> Any:
    """The uvicorn configuration trajproxy is served with; `overrides` for log level, shutdown grace and so on."""
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


class _Quiet(uvicorn.Server):
    """uvicorn's server without its signal handlers: embedded in a program, Ctrl-C belongs to the program."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class UvicornFront:
    """Serve `app` on `sockets` with uvicorn: under `run()` until SIGINT or SIGTERM, under `serve()` until `stop()`."""

    def __init__(self, app: Any, sockets: list[socket.socket], log_level: str, graceful_s: float = 5.0) -> None:
        self._sockets = sockets
        self._config = uvicorn_config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=graceful_s)
        self._server = uvicorn.Server(self._config)
        self._quiet = _Quiet(self._config)

    @property
    def started(self) -> bool:
        return bool(self._server.started or self._quiet.started)

    def run(self) -> None:
        self._server.run(sockets=self._sockets)  # re-raises the signal that stopped it, once shut down

    async def serve(self) -> None:
        await self._quiet.serve(sockets=self._sockets)

    def stop(self) -> None:
        self._server.should_exit = self._quiet.should_exit = True
