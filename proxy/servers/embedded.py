"""A trajproxy served from inside a Python program (a runner, a trainer script), on its event loop.

async with embedded_proxy(database_url="sqlite:///./runs.db") as proxy:
    async with AsyncTrainerClient(proxy.url, token=proxy.token) as trainer: ...
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from proxy.adapters.prometheus_metrics import PrometheusMetrics
from proxy.app import create_app
from proxy.servers.front import front
from proxy.servers.limits import Limits
from proxy.servers.sockets import listen
from proxy.settings import Settings
from proxy.storage.database_lock import check_free
from proxy.trainer_token import settle


@dataclass(frozen=True, slots=True)
class EmbeddedProxy:
    url: str  # for trainers, and agents on this machine
    socket_folder: str  # holds proxy.sock, the Unix socket sandboxes' gates relay to
    token: str | None  # the trainer token its /api requires (None only if the settings opted out)
    metrics: PrometheusMetrics  # what its /metrics shows; the program feeds the sandbox counters


class CannotListen(RuntimeError):
    """The embedded proxy's port or socket could not be bound."""


@contextlib.asynccontextmanager
async def embedded_proxy(database_url: str, port: int = 0, **settings: Any) -> AsyncIterator[EmbeddedProxy]:
    """Serve trajproxy on 127.0.0.1:`port` (0: any free port) and a Unix socket, until the block ends.

    Raises CannotListen if the port cannot be bound, StorageError if another process serves the database."""
    check_free(database_url, shared=bool(settings.get("shared")))
    with tempfile.TemporaryDirectory(prefix="trajproxy-") as folder:
        config = Settings(port=port, database_url=database_url, socket_path=f"{folder}/proxy.sock", **settings)
        config, _ = settle(config)
        try:
            sockets = listen(config)
        except OSError as e:
            raise CannotListen(f"cannot listen on port {port} ({e})") from e
        app = create_app(config)
        server = front(config.server, app, sockets, log_level="warning", graceful_s=2, limits=Limits.of(config))
        serving = asyncio.create_task(server.serve())  # no signal handlers: Ctrl-C belongs to the program
        while not server.started:
            if serving.done():
                serving.result()
                raise CannotListen("the embedded trajproxy stopped while starting (its log says why)")
            await asyncio.sleep(0.02)
        try:
            token = config.trainer_token.get_secret_value() if config.trainer_token else None
            yield EmbeddedProxy(f"http://127.0.0.1:{sockets[0].getsockname()[1]}", folder, token, app.metrics)
        finally:
            server.stop()
            await serving
