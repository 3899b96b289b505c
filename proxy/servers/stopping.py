"""Ending: the app as either front serves it, told as the front's shutdown begins, and answering 503 where the
shutdown then cancels a request (a call still parked after the grace) in place of a traceback."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

from proxy.http.edge import unavailable
from proxy.servers.forwarded import forwarded
from proxy.servers.limits import Limits


@runtime_checkable
class Stoppable(Protocol):
    """An app that ends what waits on it (the trainer's long polls) once told the server is stopping."""

    def stopping(self) -> None: ...


class Ending:
    """`app` behind what the limits ask of every front (forwarded headers from trusted proxies only), told once
    when the shutdown begins."""

    def __init__(self, app: Any, limits: Limits) -> None:
        self.app = app
        self._served = forwarded(app, limits.forwarded_allow_ips)
        self.begun = False

    def begin(self) -> None:
        """The shutdown has begun: the app's long polls end now, not when the grace has run out (on the server's
        event loop)."""
        if not self.begun:
            self.begun = True
            if isinstance(self.app, Stoppable):
                self.app.stopping()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self._served(scope, receive, send)
        except asyncio.CancelledError:
            if not self.begun:
                raise
            if scope["type"] == "http":  # cancelled by the shutdown: the agent's SDK retries, on the next process
                await unavailable(send)
