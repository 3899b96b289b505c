"""A trajproxy served from inside a Python program (a runner, a trainer script), on its event loop.

async with embedded_proxy(database_url="sqlite:///./runs.db") as proxy:
    async with AsyncTrainerClient(proxy.url) as trainer: ...
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from proxy.settings import Settings


@dataclass(frozen=True, slots=True)
class EmbeddedProxy:
    url: str  # for trainers, and agents on this machine
    socket_folder: str  # holds proxy.sock, the Unix socket sandboxes' gates relay to


class CannotListen(RuntimeError):
    """The embedded proxy's port or socket could not be bound."""


@contextlib.asynccontextmanager
async def embedded_proxy(database_url: str, port: int = 0, **settings: Any) -> AsyncIterator[EmbeddedProxy]:
    """Serve trajproxy on 127.0.0.1:`port` (0: any free port) and a Unix socket, until the block ends.

    Raises CannotListen if the port cannot be bound."""
    import uvicorn

    from proxy.app import create_app
    from proxy.cli import LISTEN_BACKLOG, listen

    with tempfile.TemporaryDirectory(prefix="trajproxy-") as folder:
        config = Settings(port=port, database_url=database_url, socket_path=f"{folder}/proxy.sock", **settings)
        try:
            sockets = listen(config)
        except OSError as e:
            raise CannotListen(f"cannot listen on port {port} ({e})") from e
        server = _embedded_server(
            uvicorn.Config(
                create_app(config),
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=2,
                backlog=LISTEN_BACKLOG,
            )
        )
        serving = asyncio.create_task(server.serve(sockets=sockets))
        while not server.started:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.02)
        try:
            yield EmbeddedProxy(f"http://127.0.0.1:{sockets[0].getsockname()[1]}", folder)
        finally:
            server.should_exit = True
            await serving


def _embedded_server(config: Any) -> Any:
    """uvicorn without its signal handlers: Ctrl-C belongs to the program, which closes its episodes first."""
    import uvicorn

    class EmbeddedServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return EmbeddedServer(config)
