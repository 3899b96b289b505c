"""Shutdown: the server has begun to stop. What waits on the trainer's side (a long poll, the stream) ends then, at
once: left waiting, it held the server for its whole grace and was cancelled with a traceback."""

from __future__ import annotations

import asyncio

from starlette.types import Send

from proxy.http.edge import error_body

SHUTTING_DOWN = "trajproxy is shutting down: retry"
_HEADERS = [(b"content-type", b"application/json"), (b"retry-after", b"1"), (b"connection", b"close")]


class Shutdown:
    """Set once, by the front in front of the app, on the server's event loop, as its shutdown begins."""

    def __init__(self) -> None:
        self._begun = asyncio.Event()

    @property
    def begun(self) -> bool:
        return self._begun.is_set()

    def begin(self) -> None:
        self._begun.set()

    async def wait(self) -> None:
        await self._begun.wait()


async def unavailable(send: Send) -> None:
    """Answer 503 to a request the shutdown ended, unless its answer had begun (a stream then just ends)."""
    try:
        await send({"type": "http.response.start", "status": 503, "headers": _HEADERS})
        await send({"type": "http.response.body", "body": error_body("unavailable", SHUTTING_DOWN)})
    except (RuntimeError, OSError):  # its answer had begun, or its client is gone: nothing more to say
        return
